"""Constrained sampling with a tiny random model (dgpp.testing's qwen3 checkpoint, logits from its forward
pass) and the tiny tokenizer: the output always parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from dgpp_qwen.dialect import QwenXmlDialect

from dgpp.testing.builders import build_tiny_checkpoint, load_reference
from dgpp.text import ChatTemplate, ChoiceOutput, GrammarContext, build_matcher
from test_grammar import LAMP, PERSON


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny_qwen3"), seed=3)
    return load_reference(path)


def generate(model, prompt_ids, matcher, seed, max_tokens=200):
    """Sample at temperature 1 from the model's masked logits, reusing the KV cache between steps."""
    gen = torch.Generator().manual_seed(seed)
    ids, past, out = torch.tensor([prompt_ids]), None, []
    with torch.no_grad():
        for _ in range(max_tokens):
            res = model(input_ids=ids, cache=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[0, -1].float()
            logits = logits.masked_fill(~matcher.mask(logits.shape[0]), float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            assert matcher.accept(token)
            out.append(token)
            if matcher.is_done():
                return out
            ids = torch.tensor([[token]])
    raise AssertionError("the constrained output did not finish")


def test_json_schema_with_tiny_model(tiny_model, tiny_tokenizer):
    ctx = GrammarContext(tiny_tokenizer, vocab_size=512)
    ct = ChatTemplate.for_checkpoint(tiny_tokenizer)
    prompt = ct.render([{"role": "user", "content": "Describe a person as JSON."}], chat_template_kwargs={"enable_thinking": False})
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):  # the model's forward dominates: a few samples; test_grammar draws 100
        ids = generate(tiny_model, tiny_tokenizer.encode(prompt), build_matcher(ctx, response_format=fmt), seed)
        out = ChoiceOutput(tiny_tokenizer, prompt=prompt)
        text = "".join(d.get("content", "") for t in ids for d in out.push(t)) + "".join(d.get("content", "") for d in out.finish())
        jsonschema.validate(json.loads(text), PERSON)


def test_required_tool_call_with_tiny_model(tiny_model, tiny_tokenizer):
    """A required single call sampled from the model; ChoiceOutput reports it with finish_reason tool_calls."""
    ctx = GrammarContext(tiny_tokenizer, vocab_size=512)
    ct = ChatTemplate.for_checkpoint(tiny_tokenizer)
    prompt = ct.render([{"role": "user", "content": "Dim the hall."}], [LAMP], chat_template_kwargs={"enable_thinking": False})
    dialect = QwenXmlDialect()
    for seed in range(2):
        m = build_matcher(ctx, tools=[LAMP], tool_choice="required", parallel_tool_calls=False, dialect=dialect)
        ids = generate(tiny_model, tiny_tokenizer.encode(prompt), m, seed)
        out = ChoiceOutput(tiny_tokenizer, prompt=prompt, dialect=dialect, tools=[LAMP])
        for t in ids:
            out.push(t)
        out.finish()
        assert out.finish_reason("stop") == "tool_calls" and len(out.tool_calls) == 1
        for call in out.tool_calls:
            jsonschema.validate(json.loads(call.arguments), LAMP["function"]["parameters"])
