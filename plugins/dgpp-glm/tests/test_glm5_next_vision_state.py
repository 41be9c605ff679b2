"""glm5_next prompts with images through the engine: chunked prefill (cuts inside an image's placeholders and the
indexer's pools) gives the one-shot greedy tokens and runs the encoder once per image, prompts with images batched
with each other and with a text prompt give their solo tokens, and the prefix cache's keys follow the processed
pixels."""

from __future__ import annotations

import json

import pytest
import torch

from dgpp.offline import greedy_generate
from dgpp.sched.block_pool import BlockPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp_glm.glm5_next_images import Glm5NextImageInput
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next_vl

pytest.importorskip("PIL.Image")
from test_glm5_next_vision import PICTURES, image_prompt, picture  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_glm5_next_vl(tmp_path_factory.mktemp("glm5_next_vl_state"), seed=8)
    images = Glm5NextImageInput.from_checkpoint(json.loads((path / "config.json").read_text()), path)
    return path, load_model(path), images


def prompts_with_images(path, images):
    """Two prompts with images (one image; two images) and their processed pictures."""
    first = [images.process(picture(*PICTURES[1]))]
    second = [images.process(picture(*PICTURES[2])), images.process(picture(*PICTURES[5]))]
    p1 = image_prompt(path, images, first, [[97, 104, 105, 32], [119, 104, 97, 116, 63, 98]])
    p2 = image_prompt(path, images, second, [[97, 65], [32, 97, 110, 100], [33, 98]])
    return [(p1, first), (p2, second)]


def test_chunked_prefill_equals_one_shot_and_encodes_each_image_once(setup):
    path, model, images = setup
    calls: list[int] = []
    tower = model.visual
    encode = tower.encode
    tower.encode = lambda ims: calls.append(len(ims)) or encode(ims)
    try:
        for prompt, pictures in prompts_with_images(path, images):
            one_shot = greedy_generate(model, [prompt], 12, media=[images.prompt_media(prompt, pictures)])
            for chunk in (1, 5, 16):
                calls.clear()
                media = images.prompt_media(prompt, pictures)
                chunked = greedy_generate(model, [prompt], 12, chunk_size=chunk, media=[media])
                assert chunked == one_shot, f"chunk {chunk}"
                assert sum(calls) == len(pictures), f"chunk {chunk}: encoder calls {calls}"
                assert all(im.embeddings is None for im in media.images)  # dropped once written
    finally:
        del tower.encode


def test_batched_with_images_and_text_equals_solo(setup):
    path, model, images = setup
    (p1, i1), (p2, i2) = prompts_with_images(path, images)
    text = conf.make_prompts(model.info.vocab_size, (30,), seed=3)[0]
    prompts = [p1, text, p2]

    def media():
        return [images.prompt_media(p1, i1), None, images.prompt_media(p2, i2)]

    together = greedy_generate(model, prompts, 10, media=media())
    solo = [greedy_generate(model, [p], 10, media=[m])[0] for p, m in zip(prompts, media(), strict=True)]
    assert together == solo
    assert greedy_generate(model, prompts, 10, chunk_size=7, media=media()) == solo


def test_images_change_the_answer(setup):
    """The same prompt with another picture in the placeholders continues differently: the tokens read pixels."""
    path, model, images = setup
    (prompt, pictures), _ = prompts_with_images(path, images)
    other = [images.process(picture(*PICTURES[1], seed=77))]
    assert other[0].num_tokens == pictures[0].num_tokens
    mine = greedy_generate(model, [prompt], 12, media=[images.prompt_media(prompt, pictures)])
    theirs = greedy_generate(model, [prompt], 12, media=[images.prompt_media(prompt, other)])
    assert mine != theirs


def test_prefix_cache_keys_follow_the_processed_pixels(setup):
    path, _, images = setup
    (prompt, pictures), _ = prompts_with_images(path, images)
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
