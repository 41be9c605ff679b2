"""glm5_next prompts with images through the engine: chunked prefill (cuts inside an image's placeholders and the
indexer's pools) gives the one-shot greedy tokens and runs the encoder once per image, prompts with images batched
with each other and with a text prompt give their solo tokens, and the prefix cache's keys follow the processed
pixels."""

from __future__ import annotations

import pytest

from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing.images import (
    check_batched_with_images_equals_solo,
    check_chunked_prefill_encodes_each_image_once,
    check_prefix_keys_follow_the_processed_pixels,
    image_input_of,
    picture,
)
from dgpp_glm.glm5_next_images import Glm5NextImageInput
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next_vl

pytest.importorskip("PIL.Image")
from test_glm5_next_vision import PICTURES, image_prompt  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_glm5_next_vl(tmp_path_factory.mktemp("glm5_next_vl_state"), seed=8)
    images = image_input_of(path, Glm5NextImageInput.from_checkpoint)
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
    check_chunked_prefill_encodes_each_image_once(
        model, model.visual, images, prompts_with_images(path, images)
    )


def test_batched_with_images_and_text_equals_solo(setup):
    path, model, images = setup
    check_batched_with_images_equals_solo(model, images, *prompts_with_images(path, images))


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
    (prompt, _), _ = prompts_with_images(path, images)
    check_prefix_keys_follow_the_processed_pixels(images, prompt, PICTURES[1])
