"""Constrained decoding: sampled output always satisfies the schema / tool_choice; errors name the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conversations import TIME_TOOL, WEATHER_TOOL

from dgpp.text.errors import GrammarError
from dgpp.text.grammar import GrammarContext, build_matcher
from dgpp.text.tools import tool_specs
from dgpp_deepseek.dialect import dialect_for as deepseek_dialect
from dgpp_flint.dialect import FlintJsonDialect
from dgpp_mimo.dialect import MimoDialect
from dgpp_qwen.dialect import QwenXmlDialect

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
# Tools whose arguments a random sampler finishes quickly (bare-text strings would run on indefinitely).
LAMP = {
    "type": "function",
    "function": {
        "name": "set_lamp",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "room": {"type": "string", "enum": ["hall", "kitchen"]},
                "level": {"type": "integer", "minimum": 0, "maximum": 10},
            },
            "required": ["room", "level"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "alarm",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
    },
}


@pytest.fixture(scope="module")
def tiny_ctx(tiny_tokenizer):
    return GrammarContext(tiny_tokenizer, vocab_size=512)


def sample(matcher, vocab, seed, max_tokens=400, logits_fn=None):
    """A random-logits stand-in for a model: masked, seeded draws until the matcher is done."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        logits = torch.randn(vocab, generator=gen) if logits_fn is None else logits_fn(out)
        mask = matcher.mask(vocab)
        assert mask.any(), "the constraint left no token to sample"
        logits = logits.masked_fill(~mask, float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert matcher.accept(token)
        out.append(token)
        if matcher.is_done():
            return out
    raise AssertionError(f"no complete structure within {max_tokens} tokens")


def strip_eos(tokenizer, ids):
    return [i for i in ids if i not in tokenizer.eos_token_ids]


def test_json_schema_samples_always_validate(tiny_ctx, tiny_tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(100):
        m = build_matcher(tiny_ctx, response_format=fmt)
        text = tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, seed)))
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("dialect", [QwenXmlDialect(), MimoDialect()], ids=["qwen", "mimo"])
def test_tool_choice_required_always_yields_valid_calls(tiny_ctx, tiny_tokenizer, dialect):
    """Qwen pads values with newlines, MiMo writes them bare: each grammar writes its own layout."""
    specs = tool_specs([LAMP, ALARM])
    schemas = {s.name: s.parameters for s in specs}
    counts = set()
    for seed in range(40):
        m = build_matcher(tiny_ctx, tools=[LAMP, ALARM], tool_choice="required", dialect=dialect)
        text = tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, seed)))
        parsed = dialect.parse(text, specs)
        assert parsed.tool_calls and parsed.content is None, text
        assert (re.search(r"<parameter=\w+>\n", text) is not None) == dialect.padded_values, text
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        counts.add(len(parsed.tool_calls))
    assert max(counts) > 1  # parallel calls happen when allowed


def test_flint_json_calls_under_required_are_valid(tiny_ctx, tiny_tokenizer):
    """Flint's JSON-in-<tool_call> grammar: every sampled output parses back to schema-valid calls."""
    dialect = FlintJsonDialect()
    specs = tool_specs([LAMP])  # strict: the JSON arguments close (a lenient object may grow without end)
    schemas = {s.name: s.parameters for s in specs}
    for seed in range(10):
        m = build_matcher(tiny_ctx, tools=[LAMP], tool_choice="required", dialect=dialect)
        text = tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, seed)))
        parsed = dialect.parse(text, specs)
        assert parsed.tool_calls and parsed.content is None, text
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_named_tool_and_no_parallel_calls(tiny_ctx, tiny_tokenizer):
    dialect = QwenXmlDialect()
    for seed in range(10):
        m = build_matcher(
            tiny_ctx,
            tools=[LAMP, ALARM],
            tool_choice={"type": "function", "function": {"name": "alarm"}},
            dialect=dialect,
        )
        parsed = dialect.parse(
            tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, seed))), tool_specs([LAMP, ALARM])
        )
        assert [c.name for c in parsed.tool_calls] == ["alarm"]
        m = build_matcher(
            tiny_ctx, tools=[LAMP, ALARM], tool_choice="required", parallel_tool_calls=False, dialect=dialect
        )
        parsed = dialect.parse(
            tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, seed))), tool_specs([LAMP, ALARM])
        )
        assert len(parsed.tool_calls) == 1
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "set_lamp"}}],
        },
    }
    m = build_matcher(tiny_ctx, tools=[LAMP, ALARM], tool_choice=allowed, dialect=dialect)
    parsed = dialect.parse(
        tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, 3))), tool_specs([LAMP, ALARM])
    )
    assert {c.name for c in parsed.tool_calls} == {"set_lamp"}


def test_eos_withheld_until_complete(tiny_ctx, tiny_tokenizer):
    eos_ids = sorted(tiny_tokenizer.eos_token_ids)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    m = build_matcher(tiny_ctx, response_format=fmt)
    text = '{"name": "Bo", "age": 7, "tags": ["a"], "ok": true}'
    for tid in tiny_tokenizer.encode(text):
        mask = m.mask(512)
        assert not mask[eos_ids].any() and not m.accept(eos_ids[0])  # an EOS now would cut the JSON short
        assert mask[tid] and m.accept(tid)
    mask = m.mask(512)
    assert mask[eos_ids].all() and int(mask.sum()) == len(eos_ids)  # complete: only EOS remains
    assert m.accept(eos_ids[0]) and m.is_done() and not m.mask(512).any()


def test_unconstrained_requests_get_no_matcher(tiny_ctx):
    assert build_matcher(tiny_ctx) is None
    assert (
        build_matcher(
            tiny_ctx,
            response_format={"type": "text"},
            tools=[LAMP],
            tool_choice="auto",
            dialect=QwenXmlDialect(),
        )
        is None
    )


def test_bad_constraints_name_the_field(tiny_ctx):
    bad = {"type": "object", "properties": {"x": {"type": "string", "format": "not-a-format"}}}
    with pytest.raises(GrammarError) as err:
        build_matcher(
            tiny_ctx,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "b", "schema": bad, "strict": True},
            },
        )
    assert err.value.param == "response_format.json_schema.schema"
    with pytest.raises(GrammarError) as err:  # not strict: still refused (OpenAI's answer), never loosened
        build_matcher(
            tiny_ctx, response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}}
        )
    assert err.value.param == "response_format.json_schema.schema"
    with pytest.raises(GrammarError) as err:
        build_matcher(
            tiny_ctx,
            tools=[LAMP],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            dialect=QwenXmlDialect(),
        )
    assert err.value.param == "tool_choice"


def test_real_outputs_pass_the_mask_deepseek(deepseek_v4):
    """DSML calls after a thinking block, on the real DeepSeek vocabulary (</think> is a special token there)."""
    ctx = GrammarContext(deepseek_v4, vocab_size=129280)
    dialect = deepseek_dialect({"model_type": "deepseek_v41"})
    m = build_matcher(
        ctx,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        dialect=dialect,
        prompt_opens_thinking=True,
    )
    text = "Need weather.</think>\n\n" + dialect.format_calls(
        [("get_weather", {"city": "Paris </x>", "days": 3}), ("get_time", {})]
    )
    for tid in deepseek_v4.encode(text):
        mask = m.mask(129280)
        assert mask[tid] and not mask[1]
        assert m.accept(tid)
    assert m.mask(129280)[1] and m.accept(1) and m.is_done()


def test_custom_tool_regex_grammar(tiny_ctx, tiny_tokenizer):
    shell = {
        "type": "custom",
        "custom": {
            "name": "calc",
            "format": {
                "type": "grammar",
                "grammar": {"syntax": "regex", "definition": "[0-9]{1,3}[+*][0-9]{1,3}"},
            },
        },
    }
    dialect = QwenXmlDialect()
    for seed in range(10):
        m = build_matcher(
            tiny_ctx, tools=[shell], tool_choice="required", parallel_tool_calls=False, dialect=dialect
        )
        parsed = dialect.parse(
            tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, seed))), tool_specs([shell])
        )
        call = parsed.tool_calls[0].as_openai()
        assert call["type"] == "custom" and __import__("re").fullmatch(
            r"[0-9]{1,3}[+*][0-9]{1,3}", call["custom"]["input"]
        )


def test_rollback_restores_the_mask(tiny_ctx, tiny_tokenizer):
    m = build_matcher(tiny_ctx, response_format={"type": "json_object"})
    first = m.mask(512).clone()
    ids = tiny_tokenizer.encode('{"a": 1')
    for tid in ids:
        assert m.accept(tid)
    m.rollback(len(ids))
    assert torch.equal(m.mask(512), first)


def test_json_answer_or_call_under_auto(tiny_ctx, tiny_tokenizer):
    """response_format JSON with tools under auto: either a JSON value or calls, never free text."""
    dialect = QwenXmlDialect()
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    kinds = set()
    for seed in range(30):
        m = build_matcher(
            tiny_ctx, response_format=fmt, tools=[LAMP, ALARM], tool_choice="auto", dialect=dialect
        )
        text = tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, seed)))
        parsed = dialect.parse(text, tool_specs([LAMP, ALARM]))
        if parsed.tool_calls:
            kinds.add("call")
            assert parsed.content is None
        else:
            kinds.add("json")
            jsonschema.validate(json.loads(text), PERSON)
    assert kinds == {"call", "json"}


def test_custom_tool_lark_grammar(tiny_ctx, tiny_tokenizer):
    lark = 'start: expr\nexpr: NUM (OP NUM)?\nNUM: /[0-9]{1,2}/\nOP: "+" | "-"'
    calc = {
        "type": "custom",
        "custom": {
            "name": "calc",
            "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": lark}},
        },
    }
    dialect = deepseek_dialect({"model_type": "deepseek_v4"})
    for seed in range(10):
        m = build_matcher(
            tiny_ctx,
            tools=[calc],
            tool_choice={"type": "custom", "custom": {"name": "calc"}},
            dialect=dialect,
        )
        parsed = dialect.parse(
            tiny_tokenizer.decode(strip_eos(tiny_tokenizer, sample(m, 512, seed))), tool_specs([calc])
        )
        assert __import__("re").fullmatch(
            r"[0-9]{1,2}([+-][0-9]{1,2})?", parsed.tool_calls[0].as_openai()["custom"]["input"]
        )


def test_non_strict_tool_schema_with_unknown_keyword_still_compiles(tiny_ctx):
    unique = {
        "type": "array",
        "items": {"type": "integer"},
        "uniqueItems": True,
    }  # not implemented by llguidance
    odd = {
        "type": "function",
        "function": {
            "name": "odd",
            "parameters": {"type": "object", "properties": {"ns": unique}, "required": ["ns"]},
        },
    }
    assert build_matcher(tiny_ctx, tools=[odd], tool_choice="required", dialect=QwenXmlDialect()) is not None
    strict = {"type": "function", "function": {**odd["function"], "strict": True}}
    with pytest.raises(GrammarError) as err:
        build_matcher(tiny_ctx, tools=[strict], tool_choice="required", dialect=QwenXmlDialect())
    assert err.value.param == "tool_choice" and "uniqueItems" in err.value.message


@pytest.mark.parametrize("spec", [5, "schema", [1]])
def test_json_schema_that_is_not_an_object_names_the_field(tiny_ctx, spec):
    with pytest.raises(GrammarError) as err:  # was an AttributeError (HTTP 500)
        build_matcher(tiny_ctx, response_format={"type": "json_schema", "json_schema": spec})
    assert err.value.param == "response_format.json_schema"


@pytest.mark.parametrize(
    ("tool_choice", "param"),
    [
        ({"type": "function", "function": "lamp"}, "tool_choice.function"),
        ({"type": "allowed_tools", "allowed_tools": 5}, "tool_choice.allowed_tools"),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": 5}},
            "tool_choice.allowed_tools",
        ),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["lamp"]}},
            "tool_choice.allowed_tools",
        ),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": [LAMP]}},
            "tool_choice.allowed_tools.mode",
        ),
    ],
)
def test_malformed_tool_choice_objects_name_the_field(tiny_ctx, tool_choice, param):
    # these were AttributeError / TypeError (HTTP 500), or (a bad mode) silently treated as auto
    with pytest.raises(GrammarError) as err:
        build_matcher(tiny_ctx, tools=[LAMP], tool_choice=tool_choice, dialect=QwenXmlDialect())
    assert err.value.param == param


def test_custom_tool_format_that_is_not_an_object_names_the_field(tiny_ctx):
    from dgpp.text.errors import TextError

    tool = {"type": "custom", "custom": {"name": "g", "format": 5}}
    with pytest.raises(TextError) as err:  # was an AttributeError (HTTP 500)
        build_matcher(tiny_ctx, tools=[tool], tool_choice="required", dialect=QwenXmlDialect())
    assert err.value.param == "tools[0].custom.format"


def _strict_tool(prop: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": "f",
            "strict": True,
            "parameters": {"type": "object", "properties": {"a": prop}, "required": ["a"]},
        },
    }


def _call_allowed(tiny_ctx, tiny_tokenizer, tool: dict, value: str) -> bool:
    """Whether the required-call grammar of ``tool`` lets the model write ``a=value`` (token by token)."""
    dialect = QwenXmlDialect()
    m = build_matcher(tiny_ctx, tools=[tool], tool_choice="required", dialect=dialect)
    for tid in tiny_tokenizer.encode(dialect.format_calls([("f", {"a": value})])):
        if not m.mask(tiny_ctx.vocab_size)[tid]:
            return False
        m.accept(tid)
    return m.is_accepting()


@pytest.mark.parametrize(
    ("prop", "good", "bad"),
    [
        ({"type": "string", "pattern": "^[0-9]{3}$"}, "123", "12a"),
        ({"type": "string", "pattern": "[0-9]{2}"}, "ab12cd", "abcd"),  # unanchored: a search
        ({"type": "string", "pattern": "^a/b"}, "a/b and more", "b/a"),  # a slash in a Lark regex literal
        ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
        ({"type": "string", "minLength": 2}, "ab", "a"),
    ],
)
def test_strict_string_arguments_obey_pattern_and_length(tiny_ctx, tiny_tokenizer, prop, good, bad):
    # bare-text string arguments used to be free text whatever the strict schema said
    assert _call_allowed(tiny_ctx, tiny_tokenizer, _strict_tool(prop), good)
    assert not _call_allowed(tiny_ctx, tiny_tokenizer, _strict_tool(prop), bad)
    lax = _strict_tool(prop)
    lax["function"]["strict"] = False
    assert _call_allowed(tiny_ctx, tiny_tokenizer, lax, bad)  # non-strict stays lenient


@pytest.mark.parametrize(
    "prop",
    [
        {"type": "string", "pattern": "^a|b$"},
        {"type": "string", "pattern": "[0-9]", "maxLength": 3},
        {"type": "string", "pattern": "(?=a)a"},
    ],
)
def test_strict_string_constraints_that_cannot_be_enforced_are_refused(tiny_ctx, prop):
    with pytest.raises(GrammarError):
        build_matcher(tiny_ctx, tools=[_strict_tool(prop)], tool_choice="required", dialect=QwenXmlDialect())
