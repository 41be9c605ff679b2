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


def test_reasoning_tokens_cut_mid_thinking_count_generated_ids_only(tiny_tokenizer):
    """A choice cut (length) while still thinking: every generated id is a reasoning id, and the final flush
    of held-back text is not one more (the original engine counts ids up to and including </think>)."""
    out = ChoiceOutput(tiny_tokenizer, prompt="<|im_start|>assistant\n<think>\n")
    ids = tiny_tokenizer.encode("Still thinking about 2+2 是 4 <")  # "<" may start </think>: held back
    for tid in ids:
        out.push(tid)
    deltas = out.finish()
    assert out.reasoning_tokens == len(ids) == out.completion_tokens
    assert out.reasoning.endswith("4 <") and any(d.get("reasoning_content", "").endswith("<") for d in deltas)


def test_reasoning_tokens_stop_at_the_closing_tag(tiny_tokenizer):
    out = ChoiceOutput(tiny_tokenizer, prompt="<|im_start|>assistant\n<think>\n")
    ids = tiny_tokenizer.encode("hmm, four.</think>\n\nThe answer is 4.")
    feed(out, tiny_tokenizer, "hmm, four.</think>\n\nThe answer is 4.")
    upto = next(k for k in range(1, len(ids) + 1) if "</think>" in tiny_tokenizer.decode(ids[:k]))
    assert out.reasoning_tokens == upto and out.content == "The answer is 4."


def test_ids_past_the_tokenizer_pass_through_as_no_text(tiny_tokenizer):
    """Tiny models pad their vocabulary past the tokenizer's: such ids are counted and carry no text,
    inside reasoning, in content, and across a stop string."""
    padded = tiny_tokenizer.vocab_size + 7
    out = ChoiceOutput(tiny_tokenizer, prompt="<|im_start|>assistant\n<think>\n", stop=["world"])
    ids = [padded] + tiny_tokenizer.encode("ok</think>") + [padded, padded + 1]
    ids += tiny_tokenizer.encode("Hello") + [padded] + tiny_tokenizer.encode(" world and more")
    deltas = []
    for tid in ids:
        deltas += out.push(tid)
        if out.stopped:
            break
    deltas += out.finish()
    assert out.reasoning == "ok" and out.content == "Hello "
    closing = 1 + next(k for k in range(1, 20) if "</think>" in tiny_tokenizer.decode(ids[1 : 1 + k]))
    assert out.reasoning_tokens == closing
    known = [i if i < padded - 7 else None for i in ids]
    matched = next(
        k
        for k in range(1, len(ids) + 1)
        if "world" in tiny_tokenizer.decode([i for i in known[:k] if i is not None])
    )
    assert out.completion_tokens == matched
