"""GLM-5.3-Flash's image input vs transformers on a tiny random fp32 checkpoint with a two-block vision tower: the
GLM5-Next processor's pixel rows on real pictures made with Pillow (sizes and aspect ratios below, inside and over
the token budget; RGB, RGBA, grayscale, palette with transparency; PNG, JPEG, WebP), the tower's output, and the
whole model's logits and 32 greedy tokens on a prompt with two images (embeddings at the placeholders, before the
residual streams)."""

from __future__ import annotations

import json

import pytest
import torch

from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing.images import (
    check_pixels_equal_the_processor,
    image_input_of,
    picture,
    reference_inputs,
    tower_outputs,
)
from dgpp_glm.glm5_next_images import Glm5NextImageInput, image_input
from dgpp_glm.testing_glm5_next import (
    TINY_GLM5_NEXT_PREPROCESSOR,
    build_tiny_glm5_next,
    build_tiny_glm5_next_vl,
)

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
transformers.logging.set_verbosity_error()

# (width, height, mode, format): below the 4-token minimum (enlarged), inside the budget (padded, not resized),
# over the 36-token maximum (shrunk), tall and wide; every mode a picture arrives in
PICTURES = [
    (40, 24, "RGB", "PNG"),
    (17, 53, "RGBA", "PNG"),
    (64, 64, "L", "JPEG"),
    (100, 30, "RGB", "WEBP"),
    (9, 9, "LA", "PNG"),
    (31, 12, "P", "PNG"),
    (250, 180, "RGB", "JPEG"),
    (48, 300, "RGBA", "WEBP"),
    (84, 56, "RGB", "PNG"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_glm5_next_vl(tmp_path_factory.mktemp("glm5_next_vl"), seed=5)


@pytest.fixture(scope="module")
def images(checkpoint):
    return image_input_of(checkpoint, Glm5NextImageInput.from_checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.AutoModelForImageTextToText.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def hf_processor():
    settings = {k: v for k, v in TINY_GLM5_NEXT_PREPROCESSOR.items() if k != "image_processor_type"}
    return transformers.Glm5NextImageProcessorPil(**settings)


@pytest.mark.parametrize("width,height,mode,fmt", PICTURES)
def test_pixels_equal_the_transformers_processor(images, width, height, mode, fmt):
    ours = check_pixels_equal_the_processor(images, hf_processor(), picture(width, height, mode, fmt))
    assert 4 <= ours.num_tokens == ours.grid[1] * ours.grid[2] // 4 <= 36


def test_canvas_padding_is_black_and_budget_holds(images):
    """A 100 x 60 picture is inside the budget (12 tokens): it is padded to 112 x 84, not resized; the pad is
    normalised black."""
    processed = images.process(picture(100, 60, "RGB", "PNG"))
    assert processed.grid == (1, 6, 8) and processed.num_tokens == 12
    first_patch = processed.pixels[0].view(3, 2, 14, 14)
    assert torch.equal(first_patch[:, 0], first_patch[:, 1])  # the still picture's two frames
    last_patch = processed.pixels[-1].view(3, 2, 14, 14)  # the bottom-right patch: rows 70.. are pad
    assert torch.equal(last_patch, torch.full_like(last_patch, -1.0))  # (0 - 0.5) / 0.5


@torch.inference_mode()
def test_tower_output_matches_transformers(checkpoint, images, reference):
    model = load_model(checkpoint)
    processed = [images.process(picture(*p)) for p in PICTURES[:4]]
    ours, theirs = tower_outputs(model.visual, reference.model.visual, processed)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    assert theirs.abs().max() > 0.1  # the tower's output is not vanishingly small


def image_prompt(checkpoint, images, processed, texts):
    """Token ids of ``texts[0] <image 0> texts[1] <image 1> ... texts[-1]``."""
    config = json.loads((checkpoint / "config.json").read_text())
    start, end = config["image_start_token_id"], config["image_end_token_id"]
    ids = list(texts[0])
    for image, text in zip(processed, texts[1:], strict=True):
        ids += [start, *[images.image_token_id] * image.num_tokens, end, *text]
    return ids


@torch.inference_mode()
def test_logits_and_greedy_tokens_match_transformers(checkpoint, images, reference):
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.offline import make_pools

    model = load_model(checkpoint)
    processed = [images.process(picture(*PICTURES[0])), images.process(picture(*PICTURES[3]))]
    ids = image_prompt(checkpoint, images, processed, [[97, 117, 115], [32, 99], [104, 105, 98]])
    media = images.prompt_media(ids, processed)
    pools, blocks, _ = make_pools(model, [len(ids)], 16)
    work = SeqWork(
        0, blocks.allocate(blocks.blocks_for_tokens(len(ids))), 0, ids, every_row_logits=True, media=media
    )
    ours = ModelRunner(model, pools).step([work])
    hf_inputs = reference_inputs(processed)
    theirs = reference(input_ids=torch.tensor([ids]), **hf_inputs).logits[0]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < 1e-4
    text_only = reference(input_ids=torch.tensor([ids])).logits[0]  # placeholders as plain token embeddings
    assert (text_only - theirs).abs().max() > 1e-2  # so the match above needs the images

    generated = reference.generate(
        input_ids=torch.tensor([ids]), **hf_inputs, max_new_tokens=32, do_sample=False, eos_token_id=None
    )[0, len(ids) :].tolist()
    media = images.prompt_media(ids, processed)
    assert greedy_generate(model, [ids], 32, media=[media], stop_at_eos=False)[0] == generated


def test_memory_plan_counts_the_tower_and_its_workspace(checkpoint, images):
    from dgpp.family import LoadContext
    from dgpp.plugins import manager
    from dgpp.startup.loading import read_hf_config

    hf_config = read_hf_config(checkpoint)
    arch = "Glm5NextForConditionalGeneration"
    plan = manager().hook.dgpp_memory_plan(ctx=LoadContext(checkpoint, hf_config, "glm", arch))
    model = load_model(checkpoint)
    tower = sum(p.numel() * p.element_size() for p in model.visual.parameters())
    text = {k: v for k, v in hf_config.items() if k != "vision_config"}
    text_plan = manager().hook.dgpp_memory_plan(ctx=LoadContext(checkpoint, text, "glm", arch))
    assert plan.weights - text_plan.weights == tower > 0
    assert "vision_workspace" not in text_plan.extra
    # the largest canvas: 36 tokens = 144 patches, each at least its fp32 pixel row of 3 x 2 x 14² values
    assert images.max_patches == 144
    assert plan.extra["vision_workspace"] >= 144 * 3 * 2 * 14 * 14 * 4


def test_the_hook_offers_images_only_with_a_processor_config(checkpoint, tmp_path):
    from dgpp.startup.loading import read_hf_config

    assert isinstance(image_input(read_hf_config(checkpoint), str(checkpoint)), Glm5NextImageInput)
    bare = build_tiny_glm5_next(tmp_path / "bare")  # a vision tower, no preprocessor_config.json
    assert image_input(read_hf_config(bare), str(bare)) is None


@pytest.mark.parametrize(
    ("change", "named"),
    [({"patch_size": 16}, "patch_size"), ({"do_normalize": False}, "do_normalize"), ({}, "tokenizer.json")],
)
def test_processor_config_refusals_name_the_file_and_key(checkpoint, tmp_path, change, named):
    import shutil

    from dgpp.plugin_api import ConfigError

    hf_config = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**TINY_GLM5_NEXT_PREPROCESSOR, **change}))
    if change:
        shutil.copy(checkpoint / "tokenizer.json", tmp_path)  # else no tokenizer: the markers are missing
    with pytest.raises(ConfigError, match=named):
        Glm5NextImageInput.from_checkpoint(hf_config, tmp_path)


@torch.inference_mode()
def test_bf16_tower_tracks_transformers_bf16(tmp_path):
    """The released dtype: the tower computes in bf16 (rotation and norms' statistics in fp32, as transformers
    does); the outputs agree to bf16 rounding (measured: 0.0056 at a magnitude of 0.44, three bf16 steps)."""
    path = build_tiny_glm5_next_vl(tmp_path / "bf16", seed=5, dtype=torch.bfloat16)
    images = image_input_of(path, Glm5NextImageInput.from_checkpoint)
    model = load_model(path)
    assert model.visual.patch_embed.proj.weight.dtype == torch.bfloat16
    reference = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).eval()
    processed = [images.process(picture(*p)) for p in PICTURES[:4]]
    ours, theirs = tower_outputs(model.visual, reference.model.visual, processed)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert (ours.float() - theirs.float()).abs().max() <= 0.02 * theirs.float().abs().max()


def test_release_plan_counts_the_bf16_tower_and_its_workspace(tmp_path):
    """At release geometry (24 blocks of 1024, merger to 4096) the NVFP4-FP8 release's plan holds the tower in BF16
    on every rank (replicated; on the release's BF16 list, so even a config whose ignore list leaves it out plans
    it dense, as the loader reads it), 563,627,008 weights = 1.05 GiB, and the workspace of the largest canvas
    the processor allows (8000 tokens by default: 1.90 GiB)."""
    from test_glm5_next_plan import GLM_5_3_FLASH, _checkpoint

    from dgpp.family import LoadContext, World
    from dgpp.plugins import build_manager
    from dgpp.startup.memory_plan import plan_for
    from dgpp.step.memory import GiB
    from dgpp_glm.glm5_next_config import Glm5NextArchConfig
    from dgpp_glm.memory import vision_workspace_bytes

    vision = {"depth": 24, "hidden_size": 1024, "num_heads": 16, "out_hidden_size": 4096}
    quant = GLM_5_3_FLASH["quantization_config"]
    short_ignore = {**quant, "fp8": {**quant["fp8"], "modules_to_not_convert": ["lm_head"]}}
    with_tower = {**GLM_5_3_FLASH, "vision_config": vision, "quantization_config": short_ignore}
    ids = {154830: "<|begin_of_image|>", 154831: "<|end_of_image|>", 154854: "<|image|>"}

    def plan(hf_config, name):
        path = _checkpoint(tmp_path / name)
        (path / "config.json").write_text(json.dumps(hf_config))
        if "vision_config" in hf_config:
            (path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "merge_size": 2}))
            added = [{"id": i, "content": text} for i, text in ids.items()]
            (path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
        ctx = LoadContext(path, hf_config, "glm", "Glm5NextForConditionalGeneration", world=World(0, 4))
        return plan_for(build_manager(), ctx)

    text_only = {**GLM_5_3_FLASH, "quantization_config": short_ignore}
    ours, text = plan(with_tower, "tower"), plan(text_only, "text")
    assert ours.weights - text.weights == 563_627_008 * 2 and 1.04 < 563_627_008 * 2 / GiB < 1.06
    tower = Glm5NextArchConfig.from_hf_config(with_tower).vision
    assert tower is not None
    assert ours.extra["vision_workspace"] == vision_workspace_bytes(tower, 8000 * 4, 2) > 1.8 * GiB
    assert "vision_workspace" not in text.extra
