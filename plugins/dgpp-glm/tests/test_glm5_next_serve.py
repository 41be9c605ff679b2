"""End to end: ``dgpp serve`` on a tiny GLM-5.3-Flash checkpoint (GLM's own chat template) through the openai SDK.
Chunked prefill under a token budget, concurrent requests and a prefix-cache hit (KDA state and the open index
pool's ring restored from a snapshot, latent and pooled-key pages shared) return exactly the runner's greedy tokens
on prompts past the indexer's dense limit; a forced tool call comes back parsed from GLM's ``<arg_key>`` /
``<arg_value>`` markers, ``<think>`` text comes back as ``reasoning_content``, and an image part is refused by
name."""

from __future__ import annotations

import json

import openai
import pytest
from served_greedy import QUESTIONS, SERVE_ENGINE, check_served_greedy, served

from dgpp.text.tokenizer import Tokenizer
from dgpp_glm.dialect import chat_template
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}


def test_served_glm5_next_greedy_tool_call_reasoning_and_refusals(tmp_path) -> None:
    ckpt = build_tiny_glm5_next(tmp_path / "ckpt", seed=61)
    (ckpt / "chat_template.jinja").write_text(
        chat_template(), encoding="utf-8"
    )  # GLM's, for server and runner
    with served(ckpt, tmp_path, chat_template=False) as (_, sdk):
        check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=12)  # 3+ complete pools: sparse rows
        model = str(ckpt)
        user = [{"role": "user", "content": "What is the weather in Paris?"}]
        no_think = {"chat_template_kwargs": {"enable_thinking": False}}

        forced = sdk.chat.completions.create(
            model=model,
            messages=user,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            temperature=0,
            extra_body=no_think,
        )
        choice = forced.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")

        think = Tokenizer.from_dir(ckpt).encode("<think>")
        assert len(think) == 1
        thought = sdk.chat.completions.create(
            model=model,
            messages=user,
            max_tokens=6,
            temperature=0,
            logit_bias={str(think[0]): 100},  # the model opens a thinking block and never closes it
            extra_body={"ignore_eos": True},
        )
        message = thought.choices[0].message
        assert message.content == "" and message.model_extra["reasoning_content"]
        assert thought.usage.completion_tokens_details.reasoning_tokens == 5  # all but the opening tag

        image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": image}], max_tokens=4
            )
        assert repr(model) in refused.value.message and "content[0]" in str(refused.value.body)


def test_served_glm5_next_with_fp4_latents_equals_the_runner(tmp_path) -> None:
    """``engine.kv_dtype: fp4``: packed fp4 latents and e4m3 pooled index keys; the startup log names the lossy
    lever, and cold, prefix-hit and concurrent answers equal the runner's greedy tokens over the same cache form."""
    ckpt = build_tiny_glm5_next(tmp_path / "ckpt", seed=61)
    (ckpt / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")
    with served(ckpt, tmp_path, chat_template=False, engine={**SERVE_ENGINE, "kv_dtype": "fp4"}) as (
        server,
        sdk,
    ):
        check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=12, kv_dtype="fp4")
        log = server.log.read_text()
    assert "lossy lever on" in log and "engine.kv_dtype" in log
