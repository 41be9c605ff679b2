"""qwen4_exp prompts with images through the engine: chunked prefill (cuts inside an image's placeholders) gives
the one-shot greedy tokens and runs the encoder once per image, prompts with images batched with each other and
with text prompts give their solo tokens, and the prefix cache's keys follow the processed pixels."""

from __future__ import annotations

import pytest

from dgpp.startup.loading import load_model
from dgpp.testing.images import (
    check_batched_with_images_equals_solo,
    check_chunked_prefill_encodes_each_image_once,
    check_prefix_keys_follow_the_processed_pixels,
    image_input_of,
    picture,
)
from dgpp_qwen.qwen4_exp_images import Qwen4ExpImageInput
from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp_vl

pytest.importorskip("PIL.Image")
from test_qwen4_exp_vision import PICTURES, image_prompt  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_qwen4_exp_vl(tmp_path_factory.mktemp("qwen4_exp_vl_state"), seed=8)
    images = image_input_of(path, Qwen4ExpImageInput.from_checkpoint)
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
    check_chunked_prefill_encodes_each_image_once(model, model.visual, images, prompts_with_images(images))


def test_batched_with_images_and_text_equals_solo(setup):
    model, images = setup
    check_batched_with_images_equals_solo(model, images, *prompts_with_images(images))


def test_prefix_cache_keys_follow_the_processed_pixels(setup):
    _, images = setup
    (prompt, _), _ = prompts_with_images(images)
    check_prefix_keys_follow_the_processed_pixels(images, prompt, PICTURES[1])
