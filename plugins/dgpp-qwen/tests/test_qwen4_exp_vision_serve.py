"""End to end: ``dgpp serve`` on a tiny qwen4_exp with a vision tower, through the openai SDK. A chat with image
parts answers exactly the runner's greedy tokens for the same rendered prompt, streamed and not; the same image and
text hit the prefix cache with the cold answer, another image with the same text answers for its own pixels; bad,
remote, oversized and surplus images are OpenAI-shaped 400s naming the part, and a text-only model refuses image
parts naming the model."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
from serve_fixture import running
from served_greedy import NO_THINK, SERVE_ENGINE, ask_greedy, stream_greedy

from dgpp.testing import images as kit
from dgpp.testing.images import data_uri, picture
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp_qwen.qwen4_exp_images import Qwen4ExpImageInput
from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp, build_tiny_qwen4_exp_vl

pytestmark = pytest.mark.e2e
PIL = pytest.importorskip("PIL.Image")

IMAGES = {"max_images": 2, "max_image_bytes": 40000}
MAX_TOKENS = 10


def rendered_prompt(ckpt, msgs: list[dict]):
    return kit.rendered_prompt(ckpt, msgs, Qwen4ExpImageInput.from_checkpoint, IMAGES, NO_THINK)


def runner_answer(ckpt, msgs: list[dict]) -> str:
    return kit.runner_answer(ckpt, msgs, Qwen4ExpImageInput.from_checkpoint, IMAGES, NO_THINK, MAX_TOKENS)


def ask(sdk, ckpt, msgs, **extra):
    return ask_greedy(sdk, ckpt, msgs, MAX_TOKENS, **extra)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def messages(*parts: dict, question: str = "What is in the picture?") -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant. Look closely. " * 2},
        {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
    ]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_exp_vl_serve")
    ckpt = build_tiny_qwen4_exp_vl(root / "ckpt", seed=12)
    with running(ckpt, root, {**SERVE_ENGINE, "images": IMAGES}) as server:
        yield ckpt, server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_models_lists_image_input(served):
    ckpt, server, sdk = served
    assert sdk.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]


def test_image_chat_equals_the_runner_streamed_and_not_cold_and_hit(served):
    ckpt, _, sdk = served
    msgs = messages(image_part(data_uri(picture(40, 24, "RGB", "PNG"))))
    want = runner_answer(ckpt, msgs)
    cold = ask(sdk, ckpt, msgs, prefix_cache=False)
    assert cold.choices[0].message.content == want
    ask(sdk, ckpt, msgs)
    hit = ask(sdk, ckpt, msgs)
    assert hit.choices[0].message.content == want
    assert hit.usage.prompt_tokens_details.cached_tokens >= 16
    assert stream_greedy(sdk, ckpt, msgs, MAX_TOKENS) == want


def test_another_image_with_the_same_text_answers_for_its_own_pixels(served):
    ckpt, _, sdk = served
    first = messages(image_part(data_uri(picture(17, 53, "RGBA", "PNG"))))
    other = messages(image_part(data_uri(picture(17, 53, "RGBA", "PNG", seed=40))))
    ask(sdk, ckpt, first)
    reply = ask(sdk, ckpt, other)
    assert reply.choices[0].message.content == runner_answer(ckpt, other)
    # only the text before the image can be shared: the system prompt and the user turn's opening
    _, media = rendered_prompt(ckpt, other)
    assert 0 < reply.usage.prompt_tokens_details.cached_tokens <= media.images[0].start


def test_two_images_in_one_request(served):
    ckpt, _, sdk = served
    msgs = messages(
        image_part(data_uri(picture(64, 64, "L", "JPEG"), "JPEG")),
        image_part(data_uri(picture(100, 30, "RGB", "WEBP"), "WEBP")),
    )
    want = runner_answer(ckpt, msgs)
    assert ask(sdk, ckpt, msgs).choices[0].message.content == want
    # two choices of one request: the second attaches to the first's prefill through the prefix cache
    assert [c.message.content for c in ask(sdk, ckpt, msgs, n=2).choices] == [want, want]


def refusal(sdk, ckpt, msgs) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(sdk, ckpt, msgs)
    error = caught.value.body
    assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    "url,why",
    [
        ("https://example.com/cat.png", "remote URL"),
        ("data:image/png;base64,@@not-base64@@", "base64"),
        (
            "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode(),
            "PNG, JPEG or WebP",
        ),
        ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "media type"),
        ("data:text/plain,hello", "media type"),
    ],
)
def test_bad_images_are_400_invalid_image_naming_the_part(served, url, why):
    ckpt, _, sdk = served
    error = refusal(sdk, ckpt, messages(image_part(url)))
    assert error["code"] == "invalid_image" and error["param"] == "messages[1].content[0]"
    assert why in error["message"]


def test_oversized_and_surplus_images_are_400(served):
    ckpt, _, sdk = served
    noise = PIL.effect_noise((256, 256), 120).convert("RGB")
    error = refusal(sdk, ckpt, messages(image_part(data_uri(noise))))
    assert error["code"] == "invalid_image" and "max_image_bytes" in error["message"]
    small = image_part(data_uri(picture(12, 12, "RGB", "PNG")))
    error = refusal(sdk, ckpt, messages(small, small, small))
    assert error["code"] == "invalid_image" and error["param"] == "messages[1].content[2]"
    assert "max_images" in error["message"]
    # nothing was lost: the server still answers
    assert ask(sdk, ckpt, messages(small)).choices[0].message.content == runner_answer(ckpt, messages(small))


def test_text_only_model_refuses_image_parts_naming_the_model(tmp_path):
    ckpt = build_tiny_qwen4_exp(tmp_path / "text_only", seed=3)
    build_tiny_tokenizer(ckpt)
    with running(ckpt, tmp_path, SERVE_ENGINE) as server:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert sdk.models.list().data[0].model_extra["input_modalities"] == ["text"]
        error = refusal(sdk, ckpt, messages(image_part(data_uri(picture(12, 12, "RGB", "PNG")))))
        assert str(ckpt) in error["message"] and error["param"] == "messages[1].content[0]"


def test_image_chat_with_mtp_equals_the_runner(tmp_path):
    ckpt = build_tiny_qwen4_exp_vl(tmp_path / "ckpt_mtp", seed=12, with_mtp=True)
    msgs = messages(
        image_part(data_uri(picture(40, 24, "RGB", "PNG"))), image_part(data_uri(picture(9, 9, "LA", "PNG")))
    )
    want = runner_answer(ckpt, msgs)
    with running(ckpt, tmp_path, {**SERVE_ENGINE, "images": IMAGES, "mtp": True, "mtp_depth": 2}) as server:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert ask(sdk, ckpt, msgs).choices[0].message.content == want
        assert stream_greedy(sdk, ckpt, msgs, MAX_TOKENS) == want
        drafts = httpx.get(server.url + "/metrics").json()["scheduler"]["spec_decode"]["num_drafts_total"]
        assert drafts > 0  # the answers went through draft and verify steps
