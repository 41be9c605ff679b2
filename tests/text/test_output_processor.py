"""OutputProcessor: ids -> reasoning / content / tool-call deltas, usage counts, finish reason, message; the
reasoning split at </think> (streamed per token, reasoning tokens counted, optional fold into content)."""

from __future__ import annotations

import json

import pytest
from conversations import WEATHER_TOOL

from dgpp.sample.params import SamplingParams
from dgpp.sample.sampler import SampleResult
from dgpp.sched.request import RetireReason, SeqEvent
from dgpp.serve.output_processor import OutputProcessor, prompt_opens_thinking
from dgpp.text import ChatTemplate
from dgpp_qwen.dialect import QwenXmlDialect

THINKING = "<|im_start|>assistant\n<think>\n"  # a generation prompt that opens the thinking block


def processor(tokenizer, stop=(), **kwargs) -> OutputProcessor:
    params = SamplingParams(stop=tuple(stop))
    return OutputProcessor(0, tokenizer, params, frozenset(tokenizer.eos_token_ids), **kwargs)


def push(out, ids, retired=None):
    """Feed ``ids`` one event each, then (``retired``) the retirement; the deltas' parts."""
    parts = []
    for tid in ids:
        parts += out.feed(SeqEvent(tokens=[tid], samples=[SampleResult(tid)])).parts
        if out.finished:
            return parts
    if retired is not None:
        parts += out.feed(SeqEvent(tokens=[], samples=[], retired=retired)).parts
    return parts


def feed(out, tokenizer, text, eos=True):
    ids = tokenizer.encode(text) + ([min(tokenizer.eos_token_ids)] if eos else [])
    return push(out, ids, RetireReason.EOS)


def test_reasoning_then_tool_call(tiny_tokenizer):
    ct = ChatTemplate.for_checkpoint(tiny_tokenizer)
    prompt = ct.render([{"role": "user", "content": "weather?"}], [WEATHER_TOOL])
    out = processor(
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
    assert out.finish_reason == "tool_calls" and out.reasoning_tokens > 0
    msg = out.message()
    assert (
        msg["content"] is None
        and msg["reasoning_content"] == "Need the tool."
        and len(msg["tool_calls"]) == 1
    )


def test_tool_choice_none_leaves_calls_as_text(tiny_tokenizer):
    text = QwenXmlDialect().format_calls([("get_weather", {"city": "Paris"})])
    out = processor(tiny_tokenizer, dialect=QwenXmlDialect(), tools=[WEATHER_TOOL], tool_choice="none")
    feed(out, tiny_tokenizer, text)
    assert out.message()["content"] == text and out.finish_reason == "stop"


def test_stop_string_counts_tokens_to_the_match(tiny_tokenizer):
    out = processor(tiny_tokenizer, stop=["world"])
    deltas = feed(out, tiny_tokenizer, "Hello world, more text", eos=False)
    assert "".join(d.get("content", "") for d in deltas) == "Hello "
    ids = tiny_tokenizer.encode("Hello world, more text")
    first = next(k for k in range(1, len(ids) + 1) if "world" in tiny_tokenizer.decode(ids[:k]))
    assert out.completion_tokens == first and out.finish_reason == "stop"


def test_reasoning_tokens_cut_mid_thinking_count_generated_ids_only(tiny_tokenizer):
    """A choice cut (length) while still thinking: every generated id is a reasoning id, and the final flush
    of held-back text is not one more (the original engine counts ids up to and including </think>)."""
    out = processor(tiny_tokenizer, prompt=THINKING)
    ids = tiny_tokenizer.encode("Still thinking about 2+2 是 4 <")  # "<" may start </think>: held back
    push(out, ids)
    deltas = out.feed(SeqEvent(tokens=[], samples=[], retired=RetireReason.LENGTH)).parts
    assert out.reasoning_tokens == len(ids) == out.completion_tokens
    assert out.reasoning.endswith("4 <") and any(d.get("reasoning_content", "").endswith("<") for d in deltas)


def test_reasoning_tokens_stop_at_the_closing_tag(tiny_tokenizer):
    out = processor(tiny_tokenizer, prompt=THINKING)
    ids = tiny_tokenizer.encode("hmm, four.</think>\n\nThe answer is 4.")
    feed(out, tiny_tokenizer, "hmm, four.</think>\n\nThe answer is 4.")
    upto = next(k for k in range(1, len(ids) + 1) if "</think>" in tiny_tokenizer.decode(ids[:k]))
    assert out.reasoning_tokens == upto and out.content == "The answer is 4."


def test_ids_past_the_tokenizer_pass_through_as_no_text(tiny_tokenizer):
    """Tiny models pad their vocabulary past the tokenizer's: such ids are counted and carry no text,
    inside reasoning, in content, and across a stop string."""
    padded = tiny_tokenizer.vocab_size + 7
    out = processor(tiny_tokenizer, prompt=THINKING, stop=["world"])
    ids = [padded] + tiny_tokenizer.encode("ok</think>") + [padded, padded + 1]
    ids += tiny_tokenizer.encode("Hello") + [padded] + tiny_tokenizer.encode(" world and more")
    push(out, ids, RetireReason.LENGTH)
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


def split(tokenizer, text, opens, in_content=False):
    out = processor(tokenizer, prompt=THINKING if opens else "", reasoning_in_content=in_content)
    ids = tokenizer.encode(text)
    parts = push(out, ids, RetireReason.LENGTH)
    reasoning = "".join(p.get("reasoning_content", "") for p in parts)
    content = "".join(p.get("content", "") for p in parts)
    assert (reasoning, content) == (out.reasoning, out.content)
    return reasoning, content, out, ids


@pytest.mark.parametrize("name", ["deepseek_v4", "qwen35", "tiny_tokenizer"])
def test_prompt_opened_thinking(request, name):
    tok = request.getfixturevalue(name)
    reasoning, content, out, ids = split(
        tok, "Let me think: 2+2 是 4 😀.</think>\n\nThe answer is 4.", opens=True
    )
    assert reasoning == "Let me think: 2+2 是 4 😀." and content == "The answer is 4."
    upto = next(k for k in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:k]))
    assert out.reasoning_tokens == upto  # ids up to and including the one completing </think>


def test_model_opens_thinking_itself(tiny_tokenizer):
    reasoning, content, out, _ = split(tiny_tokenizer, "\n<think>\nhmm</think>ok", opens=False)
    assert (reasoning, content) == ("hmm", "ok") and out.reasoning_tokens > 0


def test_no_thinking(tiny_tokenizer):
    reasoning, content, out, _ = split(tiny_tokenizer, "Hello <think> world", opens=False)
    assert (reasoning, content, out.reasoning_tokens) == ("", "Hello <think> world", 0)


def test_unfinished_reasoning_stays_reasoning(tiny_tokenizer):
    reasoning, content, _, _ = split(tiny_tokenizer, "still thinking </thi", opens=True)
    assert (reasoning, content) == ("still thinking </thi", "")


def test_reasoning_in_content_folds_everything(tiny_tokenizer):
    text = "why</think>\n\nbecause"
    reasoning, content, out, _ = split(tiny_tokenizer, text, opens=True, in_content=True)
    assert reasoning == "" and content == text and out.reasoning_tokens > 0


def test_prompt_detection():
    assert prompt_opens_thinking(THINKING)
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
