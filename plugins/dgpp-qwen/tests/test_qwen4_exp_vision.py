"""Qwen3.8-Flash-Next's image input vs transformers on a tiny random fp32 checkpoint with a vision tower: the
processor's pixel rows on real pictures made with Pillow (sizes and aspect ratios, RGB, RGBA, grayscale, palette
with transparency; PNG, JPEG, WebP), the tower's output, and the whole model's logits and 32 greedy tokens on
prompts with images (multimodal RoPE positions, embeddings at the placeholders)."""

from __future__ import annotations

import pytest
import torch

from dgpp.media.prompt import ImageError
from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing.images import check_pixels_equal_the_processor, image_input_of, picture, tower_outputs
from dgpp_qwen.qwen4_exp_images import Qwen4ExpImageInput, smart_resize
from dgpp_qwen.testing_qwen4_exp import TINY_PREPROCESSOR, VISION_TOKENS, build_tiny_qwen4_exp_vl

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

# (width, height, mode, format): several sizes and aspect ratios; upscaled to the minimum and downscaled to the
# maximum pixel count; every mode a picture arrives in
PICTURES = [
    (40, 24, "RGB", "PNG"),
    (17, 53, "RGBA", "PNG"),
    (64, 64, "L", "JPEG"),
    (100, 30, "RGB", "WEBP"),
    (9, 9, "LA", "PNG"),
    (31, 12, "P", "PNG"),
    (250, 180, "RGB", "JPEG"),
    (48, 80, "RGBA", "WEBP"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_qwen4_exp_vl(tmp_path_factory.mktemp("qwen4_exp_vl"), seed=5)


@pytest.fixture(scope="module")
def image_input(checkpoint):
    return image_input_of(checkpoint, Qwen4ExpImageInput.from_checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.Qwen4ExpForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def hf_processor():
    settings = {k: v for k, v in TINY_PREPROCESSOR.items() if k != "image_processor_type"}
    return transformers.Qwen2VLImageProcessorPil(**settings)


@pytest.mark.parametrize("width,height,mode,fmt", PICTURES)
def test_pixels_equal_the_transformers_processor(image_input, width, height, mode, fmt):
    ours = check_pixels_equal_the_processor(image_input, hf_processor(), picture(width, height, mode, fmt))
    assert ours.num_tokens == ours.grid[1] * ours.grid[2] // 4


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(2, 500, 8, 64, 48 * 48)


@torch.inference_mode()
def test_tower_output_matches_transformers(checkpoint, image_input, reference):
    model = load_model(checkpoint)
    images = [image_input.process(picture(*p)) for p in PICTURES[:4]]
    ours, theirs = tower_outputs(model.visual, reference.model.visual, images)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    assert theirs.abs().max() > 0.1  # the tower's output is not vanishingly small


def image_prompt(image_input, images, texts):
    """Token ids of ``texts[0] <image 0> texts[1] <image 1> ... texts[-1]`` (text as byte-level ids)."""
    start, end = VISION_TOKENS["vision_start_token_id"][0], VISION_TOKENS["vision_end_token_id"][0]
    pad = image_input.image_token_id
    ids = list(texts[0])
    for image, text in zip(images, texts[1:], strict=True):
        ids += [start, *[pad] * image.num_tokens, end, *text]
    return ids


def hf_logits(reference, ids, images):
    ids_t = torch.tensor([ids])
    types = (ids_t == VISION_TOKENS["image_token_id"][0]).int()
    out = reference(
        input_ids=ids_t,
        pixel_values=torch.cat([im.pixels for im in images]),
        image_grid_thw=torch.tensor([im.grid for im in images]),
        mm_token_type_ids=types,
    )
    return out.logits[0]


@torch.inference_mode()
def test_logits_and_greedy_tokens_match_transformers(checkpoint, image_input, reference):
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.offline import make_pools

    model = load_model(checkpoint)
    images = [image_input.process(picture(*PICTURES[0])), image_input.process(picture(*PICTURES[3]))]
    ids = image_prompt(image_input, images, [[497, 117, 115], [32, 99], [104, 105, 498]])
    media = image_input.prompt_media(ids, images)
    pools, blocks, _ = make_pools(model, [len(ids)], 16)
    work = SeqWork(
        0, blocks.allocate(blocks.blocks_for_tokens(len(ids))), 0, ids, every_row_logits=True, media=media
    )
    ours = ModelRunner(model, pools).step([work])
    theirs = hf_logits(reference, ids, images)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < 1e-4

    generated = reference.generate(
        input_ids=torch.tensor([ids]),
        pixel_values=torch.cat([im.pixels for im in images]),
        image_grid_thw=torch.tensor([im.grid for im in images]),
        mm_token_type_ids=(torch.tensor([ids]) == image_input.image_token_id).int(),
        max_new_tokens=32,
        do_sample=False,
        eos_token_id=None,
    )[0, len(ids) :].tolist()
    media = image_input.prompt_media(ids, images)
    assert greedy_generate(model, [ids], 32, media=[media], stop_at_eos=False)[0] == generated


def test_memory_plan_counts_the_tower_and_its_workspace(checkpoint):
    from dgpp.family import LoadContext
    from dgpp.plugins import manager
    from dgpp.startup.loading import read_hf_config

    hf_config = read_hf_config(checkpoint)
    ctx = LoadContext(checkpoint, hf_config, "qwen", "Qwen4ExpForConditionalGeneration")
    plan = manager().hook.dgpp_memory_plan(ctx=ctx)
    model = load_model(checkpoint)
    tower = sum(p.numel() * p.element_size() for p in model.visual.parameters())
    text = {k: v for k, v in hf_config.items() if k != "vision_config"}
    text_plan = manager().hook.dgpp_memory_plan(ctx=LoadContext(checkpoint, text, "qwen", ctx.architecture))
    assert plan.weights - text_plan.weights == tower > 0
    # the largest picture: 48² pixels = 144 patches of 4², each at least its fp32 pixel row
    assert plan.extra["vision_workspace"] >= 144 * 4 * 3 * 2 * 16


def test_the_hook_offers_images_only_with_a_processor_config(checkpoint, tmp_path):
    from dgpp.startup.loading import read_hf_config
    from dgpp_qwen.qwen4_exp_images import image_input
    from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp

    assert isinstance(image_input(read_hf_config(checkpoint), str(checkpoint)), Qwen4ExpImageInput)
    bare = build_tiny_qwen4_exp(
        tmp_path / "bare", wrapped=True
    )  # a vision tower, no preprocessor_config.json
    assert image_input(read_hf_config(bare), str(bare)) is None
    text = build_tiny_qwen4_exp(tmp_path / "text")
    assert image_input(read_hf_config(text), str(text)) is None


@torch.inference_mode()
def test_bf16_tower_tracks_transformers_bf16(tmp_path):
    """The released dtype: the tower computes in bf16 (rotation in fp32, as transformers does); the outputs agree
    to bf16 rounding (measured: 0.031 at a magnitude of 3.2, two bf16 steps)."""
    path = build_tiny_qwen4_exp_vl(tmp_path / "bf16", seed=5, dtype=torch.bfloat16)
    images = image_input_of(path, Qwen4ExpImageInput.from_checkpoint)
    model = load_model(path)
    assert model.visual.pos_embed.weight.dtype == torch.bfloat16
    reference = transformers.Qwen4ExpForConditionalGeneration.from_pretrained(
        path, dtype=torch.bfloat16
    ).eval()
    processed = [images.process(picture(*p)) for p in PICTURES[:4]]
    ours, theirs = tower_outputs(model.visual, reference.model.visual, processed)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert (ours.float() - theirs.float()).abs().max() <= 0.02 * theirs.float().abs().max()
