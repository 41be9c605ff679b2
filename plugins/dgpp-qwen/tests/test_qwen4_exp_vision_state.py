"""qwen4_exp prompts with images through the engine: chunked prefill (cuts inside an image's placeholders) gives
the one-shot greedy tokens and runs the encoder once per image, prompts with images batched with each other and
with text prompts give their solo tokens, and the prefix cache's keys follow the processed pixels."""

from __future__ import annotations

import json

import pytest
import torch

from dgpp.offline import greedy_generate
from dgpp.sched.block_pool import BlockPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp_qwen.qwen4_exp_images import Qwen4ExpImageInput
from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp_vl

pytest.importorskip("PIL.Image")
from test_qwen4_exp_vision import PICTURES, image_prompt, picture  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_qwen4_exp_vl(tmp_path_factory.mktemp("qwen4_exp_vl_state"), seed=8)
    images = Qwen4ExpImageInput.from_checkpoint(json.loads((path / "config.json").read_text()), path)
    return load_model(path), images


def prompts_with_images(images):
    """Two prompts with images (one image; two images) and their media factories."""
    first = [images.process(picture(*PICTURES[1]))]
    second = [images.process(picture(*PICTURES[2])), images.process(picture(*PICTURES[6]))]
    p1 = image_prompt(images, first, [[497, 104, 105, 32], [119, 104, 97, 116, 63, 498]])
    p2 = image_prompt(images, second, [[497, 65], [32, 97, 110, 100], [33, 498]])
    return [(p1, first), (p2, second)]


def test_chunked_prefill_equals_one_shot_and_encodes_each_image_once(setup):
    model, images = setup
    calls: list[int] = []
    encode = model.visual.encode
    model.visual.encode = lambda ims: calls.append(len(ims)) or encode(ims)
    try:
        for prompt, pictures in prompts_with_images(images):
            one_shot = greedy_generate(model, [prompt], 12, media=[images.prompt_media(prompt, pictures)])
            for chunk in (1, 5, 16):
                calls.clear()
                media = images.prompt_media(prompt, pictures)
                chunked = greedy_generate(model, [prompt], 12, chunk_size=chunk, media=[media])
                assert chunked == one_shot, f"chunk {chunk}"
                assert sum(calls) == len(pictures), f"chunk {chunk}: encoder calls {calls}"
                assert all(im.embeddings is None for im in media.images)  # dropped once written
    finally:
        model.visual.encode = encode


def test_batched_with_images_and_text_equals_solo(setup):
    model, images = setup
    (p1, i1), (p2, i2) = prompts_with_images(images)
    text = conf.make_prompts(model.info.vocab_size, (30,), seed=3)[0]
    prompts = [p1, text, p2]

    def media():
        return [images.prompt_media(p1, i1), None, images.prompt_media(p2, i2)]

    together = greedy_generate(model, prompts, 10, media=media())
    solo = [greedy_generate(model, [p], 10, media=[m])[0] for p, m in zip(prompts, media(), strict=True)]
    assert together == solo
    chunked_together = greedy_generate(model, prompts, 10, chunk_size=7, media=media())
    assert chunked_together == solo


def test_prefix_cache_keys_follow_the_processed_pixels(setup):
    _, images = setup
    (prompt, pictures), _ = prompts_with_images(images)
    other = [images.process(picture(*PICTURES[1], seed=77))]
    cache = PrefixCache(BlockPool(64, 4), 4)
    same = cache.block_keys(images.prompt_media(prompt, pictures).key_tokens(prompt))
    again = cache.block_keys(
        images.prompt_media(prompt, [images.process(picture(*PICTURES[1]))]).key_tokens(prompt)
    )
    changed = cache.block_keys(images.prompt_media(prompt, other).key_tokens(prompt))
    image_block = images.prompt_media(prompt, pictures).images[0].start // 4
    assert same == again  # the same picture decoded again keys the same prefix
    assert changed[:image_block] == same[:image_block]  # the text before the image is shared
    assert all(a != b for a, b in zip(changed[image_block:], same[image_block:], strict=True))
    assert torch.equal(pictures[0].pixels, images.process(picture(*PICTURES[1])).pixels)
