"""Reasoning split at </think>: streamed per token, reasoning tokens counted, optional fold into content."""

from __future__ import annotations

import pytest

from dgpp.text.detokenizer import IncrementalDetokenizer
from dgpp.text.reasoning import ReasoningSplitter


def run(tokenizer, text, opens, in_content=False):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    split = ReasoningSplitter(opens, in_content=in_content)
    reasoning, content = "", ""
    for tid in ids:
        part = split.push(detok.push(tid))
        reasoning += part.reasoning
        content += part.content
    last = split.push(detok.finish())
    tail = split.finish()
    return reasoning + last.reasoning + tail.reasoning, content + last.content + tail.content, split, ids


@pytest.mark.parametrize("name", ["deepseek_v4", "qwen35", "tiny_tokenizer"])
def test_prompt_opened_thinking(request, name):
    tok = request.getfixturevalue(name)
    reasoning, content, split, ids = run(
        tok, "Let me think: 2+2 是 4 😀.</think>\n\nThe answer is 4.", opens=True
    )
    assert reasoning == "Let me think: 2+2 是 4 😀." and content == "The answer is 4."
    upto = next(k for k in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:k]))
    assert split.reasoning_tokens == upto  # ids up to and including the one completing </think>


def test_model_opens_thinking_itself(tiny_tokenizer):
    reasoning, content, split, _ = run(tiny_tokenizer, "\n<think>\nhmm</think>ok", opens=False)
    assert (reasoning, content) == ("hmm", "ok") and split.reasoning_tokens > 0


def test_no_thinking(tiny_tokenizer):
    reasoning, content, split, _ = run(tiny_tokenizer, "Hello <think> world", opens=False)
    assert (reasoning, content, split.reasoning_tokens) == ("", "Hello <think> world", 0)


def test_unfinished_reasoning_stays_reasoning(tiny_tokenizer):
    reasoning, content, _, _ = run(tiny_tokenizer, "still thinking </thi", opens=True)
    assert (reasoning, content) == ("still thinking </thi", "")


def test_reasoning_in_content_folds_everything(tiny_tokenizer):
    text = "why</think>\n\nbecause"
    reasoning, content, split, _ = run(tiny_tokenizer, text, opens=True, in_content=True)
    assert reasoning == "" and content == text and split.reasoning_tokens > 0


def test_prompt_detection():
    assert ReasoningSplitter.prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not ReasoningSplitter.prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
