"""End to end: ``dgpp serve`` on the tiny DeepSeek-V4.1 release-layout fixture (window 6, ratio-2 and ratio-1
groups, top-4 selections inside a candidate pool, Engram on two layers; all far shorter than the prompts) through
the openai SDK. Chunked prefill under a token budget, concurrent requests and a prefix-cache hit (the window rings,
the open pairs and the Engram token context restored from a state snapshot, the compressed entries' pages shared)
all return exactly the runner's greedy tokens. Served with the plugin's template, a required tool call is written
in V4.1's DSML (the spaced ``<｜DSML｜ invoke>`` tags) and comes back as an OpenAI tool call, streamed alike."""

from __future__ import annotations

import json

import pytest
from served_greedy import WEATHER_QUESTION, WEATHER_TOOL, check_family_serves, served
from test_deepseek_v41 import build_fp32_fixture

from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer
from dgpp_deepseek import dialect as deepseek_dialect

pytestmark = pytest.mark.e2e

CHAT_MODE = {"thinking": False}  # the template's chat mode: the answer starts at once


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(tmp_path) -> None:
    ckpt = build_fp32_fixture(tmp_path / "ckpt", seed=21)
    check_family_serves(ckpt, tmp_path, min_prompt_tokens=40)


def test_dsml_tool_calls_through_the_server(tmp_path) -> None:
    ckpt = build_fp32_fixture(tmp_path / "ckpt", seed=22, max_position_embeddings=2048)
    # the release's end-of-sentence id (1) is the tiny tokenizer's '"', which DSML writes: end on its own EOS
    config = json.loads((ckpt / "config.json").read_text())
    config["eos_token_id"] = config["text_config"]["eos_token_id"] = min(
        Tokenizer.from_dir(ckpt).eos_token_ids
    )
    (ckpt / "config.json").write_text(json.dumps(config))
    with served(ckpt, tmp_path, chat_template=False) as (_, sdk):
        tok = Tokenizer.from_dir(ckpt)
        hf_config = json.loads((ckpt / "config.json").read_text())
        template = deepseek_dialect.chat_template(hf_config)
        prompt = ChatTemplate(template, tok.special_tokens_map).render(
            WEATHER_QUESTION, [WEATHER_TOOL], chat_template_kwargs=CHAT_MODE
        )
        assert "<｜DSML｜ invoke name=" in prompt  # V4.1's spaced tags

        def ask(**extra):
            return sdk.chat.completions.create(
                model=str(ckpt),
                messages=WEATHER_QUESTION,
                tools=[WEATHER_TOOL],
                max_tokens=300,
                temperature=0,
                tool_choice="required",
                parallel_tool_calls=False,
                extra_body={"chat_template_kwargs": CHAT_MODE},
                **extra,
            )

        forced = ask()
        assert forced.usage.prompt_tokens == len(tok.encode(prompt))
        choice = forced.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        call = choice.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert (
            call.function.name == "get_weather"
            and args["city"] in ("Paris", "Rome")
            and 1 <= args["days"] <= 3
        )
        deltas = [
            c.choices[0].delta.tool_calls
            for c in ask(stream=True)
            if c.choices and c.choices[0].delta.tool_calls
        ]
        assert deltas[0][0].function.name == "get_weather"
        assert "".join(d[0].function.arguments or "" for d in deltas) == call.function.arguments
