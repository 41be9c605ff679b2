"""Constrained sampling with a tiny random model (dgpp.testing's qwen3 checkpoint, logits from its forward
pass) and the tiny tokenizer: 100 seeded json_schema samples parse and validate; required calls are valid."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from test_grammar import ALARM, LAMP, PERSON

from dgpp.sample.params import SamplingParams
from dgpp.sample.sampler import SampleResult
from dgpp.sched.request import RetireReason, SeqEvent
from dgpp.serve.output_processor import OutputProcessor
from dgpp.testing.builders import build_tiny_checkpoint, load_reference
from dgpp.text import ChatTemplate, GrammarContext, build_matcher
from dgpp_qwen.dialect import QwenXmlDialect


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny_qwen3"), seed=3)
    return load_reference(path)


def generate_batch(model, prompt_ids, matchers, seed, max_tokens=160):
    """One row per matcher, sampled together at temperature 1 from the model's masked logits (KV cache
    reused); a finished row keeps decoding a pad id that nobody reads."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(matchers)
    ids, past = torch.tensor([prompt_ids] * rows), None
    outs: list[list[int]] = [[] for _ in range(rows)]
    with torch.no_grad():
        for _ in range(max_tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1].float()
            nxt = []
            for r, m in enumerate(matchers):
                if m.is_done():
                    nxt.append(0)
                    continue
                row = logits[r].masked_fill(~m.mask(logits.shape[1]), float("-inf"))
                token = int(torch.multinomial(torch.softmax(row, -1), 1, generator=gen))
                assert m.accept(token)
                outs[r].append(token)
                nxt.append(token)
            if all(m.is_done() for m in matchers):
                return outs
            ids = torch.tensor(nxt).unsqueeze(1)
    raise AssertionError("some constrained outputs did not finish")


def visible_text(tokenizer, prompt, ids, **kwargs):
    out = OutputProcessor(
        0, tokenizer, SamplingParams(), frozenset(tokenizer.eos_token_ids), prompt=prompt, **kwargs
    )
    out.feed(SeqEvent(tokens=list(ids), samples=[SampleResult(t) for t in ids], retired=RetireReason.EOS))
    return out


def test_json_schema_100_samples_with_tiny_model(tiny_model, tiny_tokenizer):
    ctx = GrammarContext(tiny_tokenizer, vocab_size=512)
    prompt = ChatTemplate.for_checkpoint(tiny_tokenizer).render(
        [{"role": "user", "content": "Describe a person as JSON."}],
        chat_template_kwargs={"enable_thinking": False},
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    matchers = [build_matcher(ctx, response_format=fmt) for _ in range(100)]
    outs = generate_batch(tiny_model, tiny_tokenizer.encode(prompt), matchers, seed=11)
    texts = {visible_text(tiny_tokenizer, prompt, ids).message()["content"] for ids in outs}
    assert len(texts) > 50  # the samples really differ
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_required_tool_calls_with_tiny_model(tiny_model, tiny_tokenizer):
    ctx = GrammarContext(tiny_tokenizer, vocab_size=512)
    dialect = QwenXmlDialect()
    tools = [LAMP, ALARM]
    prompt = ChatTemplate.for_checkpoint(tiny_tokenizer).render(
        [{"role": "user", "content": "Dim the hall."}], tools, chat_template_kwargs={"enable_thinking": False}
    )
    # one call per sample: a random model rarely prefers EOS over yet another call (parallel calls are
    # drawn in test_grammar with random logits)
    matchers = [
        build_matcher(ctx, tools=tools, tool_choice="required", parallel_tool_calls=False, dialect=dialect)
        for _ in range(20)
    ]
    outs = generate_batch(tiny_model, tiny_tokenizer.encode(prompt), matchers, seed=5)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for ids in outs:
        out = visible_text(tiny_tokenizer, prompt, ids, dialect=dialect, tools=tools)
        assert out.finish_reason == "tool_calls" and out.message()["content"] is None
        assert len(out.tool_calls) == 1
        for call in out.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
