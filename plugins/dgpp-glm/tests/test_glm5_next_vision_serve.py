"""End to end: ``dgpp serve`` on a tiny GLM-5.3-Flash with a vision tower, through the openai SDK. /v1/models lists
image input; a chat with an image part answers exactly the runner's greedy tokens for the same rendered prompt,
streamed and not, cold and from the prefix cache; another image with the same text answers for its own pixels and
shares only the text before it; a broken image is a 400 naming the part."""

from __future__ import annotations

import base64

import openai
import pytest
from serve_fixture import running
from served_greedy import NO_THINK, SERVE_ENGINE, ask_greedy, stream_greedy

from dgpp.testing import images as kit
from dgpp.testing.images import data_uri, picture
from dgpp_glm.glm5_next_images import Glm5NextImageInput
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next_vl

pytestmark = pytest.mark.e2e
pytest.importorskip("PIL.Image")

IMAGES = {"max_images": 2, "max_image_bytes": 40000}
MAX_TOKENS = 10


def rendered_prompt(ckpt, msgs: list[dict]):
    return kit.rendered_prompt(ckpt, msgs, Glm5NextImageInput.from_checkpoint, IMAGES, NO_THINK)


def runner_answer(ckpt, msgs: list[dict]) -> str:
    return kit.runner_answer(ckpt, msgs, Glm5NextImageInput.from_checkpoint, IMAGES, NO_THINK, MAX_TOKENS)


def ask(sdk, ckpt, msgs, **extra):
    return ask_greedy(sdk, ckpt, msgs, MAX_TOKENS, **extra)


def messages(url: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant. Look closely. " * 2},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        },
    ]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5_next_vl_serve")
    ckpt = build_tiny_glm5_next_vl(root / "ckpt", seed=12)
    with running(ckpt, root, {**SERVE_ENGINE, "images": IMAGES}) as server:
        yield ckpt, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_models_lists_image_input(served):
    _, sdk = served
    assert sdk.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]


def test_image_chat_equals_the_runner_streamed_and_not_cold_and_hit(served):
    ckpt, sdk = served
    msgs = messages(data_uri(picture(40, 24, "RGB", "PNG")))
    want = runner_answer(ckpt, msgs)
    cold = ask(sdk, ckpt, msgs, prefix_cache=False)
    assert cold.choices[0].message.content == want
    ask(sdk, ckpt, msgs)
    hit = ask(sdk, ckpt, msgs)
    assert hit.choices[0].message.content == want
    _, media = rendered_prompt(ckpt, msgs)
    assert hit.usage.prompt_tokens_details.cached_tokens > media.images[0].end  # past the image
    assert stream_greedy(sdk, ckpt, msgs, MAX_TOKENS) == want


def test_another_image_with_the_same_text_answers_for_its_own_pixels(served):
    ckpt, sdk = served
    first = messages(data_uri(picture(17, 53, "RGBA", "PNG")))
    other = messages(data_uri(picture(17, 53, "RGBA", "PNG", seed=40)))
    ask(sdk, ckpt, first)
    reply = ask(sdk, ckpt, other)
    assert reply.choices[0].message.content == runner_answer(ckpt, other)
    # only the text before the image can be shared: the system prompt and the user turn's opening
    _, media = rendered_prompt(ckpt, other)
    assert 0 < reply.usage.prompt_tokens_details.cached_tokens <= media.images[0].start


def test_a_broken_image_is_400_naming_the_part(served):
    ckpt, sdk = served
    broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode()
    with pytest.raises(openai.BadRequestError) as caught:
        ask(sdk, ckpt, messages(broken))
    error = caught.value.body
    assert error["code"] == "invalid_image" and error["param"] == "messages[1].content[0]"
