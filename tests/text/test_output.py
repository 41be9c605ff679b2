"""ChoiceOutput: ids -> reasoning / content / tool-call deltas, usage counts, finish reason, message."""

from __future__ import annotations

import json

from conversations import WEATHER_TOOL

from dgpp.text import ChatTemplate, ChoiceOutput
from dgpp_qwen.dialect import QwenXmlDialect


def feed(out, tokenizer, text, eos=True):
    deltas = []
    for tid in tokenizer.encode(text) + ([min(tokenizer.eos_token_ids)] if eos else []):
        deltas += out.push(tid)
        if out.stopped:
            break
    return deltas + out.finish()


def test_reasoning_then_tool_call(tiny_tokenizer):
    ct = ChatTemplate.for_checkpoint(tiny_tokenizer)
    prompt = ct.render([{"role": "user", "content": "weather?"}], [WEATHER_TOOL])
    out = ChoiceOutput(
        tiny_tokenizer, prompt=prompt, dialect=QwenXmlDialect(), tools=[WEATHER_TOOL], request_tag=5
    )
    text = "Need the tool.</think>\n\n" + QwenXmlDialect().format_calls(
        [("get_weather", {"city": "Paris", "days": 2})]
    )
    deltas = feed(out, tiny_tokenizer, text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the tool."
    assert not any("content" in d for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert out.finish_reason("stop") == "tool_calls" and out.reasoning_tokens > 0
    msg = out.message()
    assert (
        msg["content"] is None
        and msg["reasoning_content"] == "Need the tool."
        and len(msg["tool_calls"]) == 1
    )


def test_tool_choice_none_leaves_calls_as_text(tiny_tokenizer):
    text = QwenXmlDialect().format_calls([("get_weather", {"city": "Paris"})])
    out = ChoiceOutput(tiny_tokenizer, dialect=QwenXmlDialect(), tools=[WEATHER_TOOL], tool_choice="none")
    feed(out, tiny_tokenizer, text)
    assert out.message()["content"] == text and out.finish_reason("stop") == "stop"


def test_stop_string_counts_tokens_to_the_match(tiny_tokenizer):
    out = ChoiceOutput(tiny_tokenizer, stop=["world"])
    deltas = feed(out, tiny_tokenizer, "Hello world, more text", eos=False)
    assert "".join(d.get("content", "") for d in deltas) == "Hello "
    ids = tiny_tokenizer.encode("Hello world, more text")
    first = next(k for k in range(1, len(ids) + 1) if "world" in tiny_tokenizer.decode(ids[:k]))
    assert out.completion_tokens == first and out.finish_reason("stop") == "stop"
