"""JSON-schema keywords structured output would silently ignore are refused by name, never loosened."""

from __future__ import annotations

import llguidance
import pytest

from dgpp.text.errors import GrammarError
from dgpp.text.grammar import GrammarContext, build_matcher
from dgpp.text.schema_keywords import unenforced_keyword
from dgpp_qwen.dialect import QwenXmlDialect

# (schema, a value that violates it, a value that satisfies it)
IGNORED = {
    "contentEncoding": ({"type": "string", "contentEncoding": "base64"}, '"!!"', '"QQ=="'),
    "contentMediaType": ({"type": "string", "contentMediaType": "application/json"}, '"{"', '"1"'),
    "discriminator": ({"type": "object", "discriminator": {"propertyName": "kind"}}, "{}", '{"kind":"a"}'),
}
ENFORCED = {
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4", "6"),
    "format": ({"type": "string", "format": "email"}, '"abc"', '"a@b.co"'),
    "minProperties": ({"type": "object", "minProperties": 1}, "{}", '{"a":1}'),
    "maxProperties": ({"type": "object", "maxProperties": 1}, '{"a":1,"b":2}', '{"a":1}'),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 1}, "1", "2"),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        '{"xa":"s"}',
        '{"xa":1}',
    ),
    "const": ({"const": 5}, "6", "5"),
}


@pytest.fixture(scope="module")
def ctx(tiny_tokenizer):
    return GrammarContext(tiny_tokenizer, vocab_size=512)


def backend_accepts(ctx: GrammarContext, schema: dict, text: str) -> bool:
    """Whether llguidance's own matcher, compiled from ``schema`` as dgpp compiles it, accepts ``text``."""
    g = ctx.builder()
    m = llguidance.LLMatcher(ctx.lltok, g.grammar(g.json(schema)))
    return all(m.consume_token(t) for t in ctx.tokenizer.encode(text)) and m.is_accepting()


def answer_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize("keyword", sorted(IGNORED))
def test_ignored_keywords_are_refused_by_name(ctx, keyword):
    schema, bad, good = IGNORED[keyword]
    # why: the backend lets a violating value through (if it learns the keyword, move it to ENFORCED)
    assert backend_accepts(ctx, schema, bad) and backend_accepts(ctx, schema, good)
    nested = {
        "type": "object",
        "properties": {"a/b": {"type": "array", "items": schema}},
        "required": ["a/b"],
    }
    with pytest.raises(GrammarError) as err:
        build_matcher(ctx, response_format=answer_format(nested))
    assert err.value.param == "response_format.json_schema.schema"
    assert repr(keyword) in err.value.message and "/properties/a~1b/items" in err.value.message


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_enforced_keywords_are_served(ctx, keyword):
    schema, bad, good = ENFORCED[keyword]
    assert not backend_accepts(ctx, schema, bad) and backend_accepts(ctx, schema, good)
    assert unenforced_keyword(schema) is None
    assert build_matcher(ctx, response_format=answer_format(schema)) is not None


def test_annotations_and_vendor_keys_pass_and_the_walk_reaches_every_subschema() -> None:
    described = {
        "type": "string",
        "title": "t",
        "description": "d",
        "default": "a",
        "examples": ["b"],
        "deprecated": False,
        "x-order": 1,
        "nullable": True,
    }
    assert unenforced_keyword(described) is None
    inner = {"type": "string", "contentEncoding": "base64"}
    for schema, where in (
        ({"anyOf": [{"type": "null"}, inner]}, "/anyOf/1"),
        ({"$defs": {"s": inner}, "$ref": "#/$defs/s"}, "/$defs/s"),
        ({"type": "array", "prefixItems": [inner]}, "/prefixItems/0"),
        ({"type": "object", "additionalProperties": inner}, "/additionalProperties"),
        ({"type": "array", "items": [{"type": "integer"}, inner]}, "/items/1"),
        ({"type": "object", "enum": [{"contentEncoding": 1}], "default": {"discriminator": 2}}, None),
    ):
        found = unenforced_keyword(schema)
        assert (found == ("contentEncoding", where)) if where else found is None, schema


def test_a_strict_tool_schema_is_held_to_the_same_rule(ctx):
    params = {
        "type": "object",
        "properties": {"blob": {"type": "string", "contentEncoding": "base64"}},
        "required": ["blob"],
    }
    loose = {"type": "function", "function": {"name": "upload", "parameters": params}}
    strict = {"type": "function", "function": {**loose["function"], "strict": True}}
    assert build_matcher(ctx, tools=[loose], tool_choice="required", dialect=QwenXmlDialect()) is not None
    with pytest.raises(GrammarError) as err:
        build_matcher(ctx, tools=[strict], tool_choice="required", dialect=QwenXmlDialect())
    assert err.value.param == "tools" and "'contentEncoding'" in err.value.message
