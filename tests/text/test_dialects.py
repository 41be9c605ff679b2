"""Every family's tool-call dialect: real syntax, streamed and not, malformed output returned as text."""

from __future__ import annotations

import json
import random

import pytest
from conversations import TIME_TOOL, WEATHER_TOOL

from dgpp.plugins import build_manager
from dgpp.text.dialect import call_id
from dgpp.text.tools import tool_specs
from dgpp_deepseek.dialect import dialect_for as deepseek_dialect
from dgpp_flint.dialect import FlintJsonDialect
from dgpp_glm.dialect import GlmDialect
from dgpp_mimo.dialect import MimoDialect
from dgpp_qwen.dialect import QwenXmlDialect

TOOLS = tool_specs([WEATHER_TOOL, TIME_TOOL])
DIALECTS = {
    "qwen": QwenXmlDialect(),
    "glm": GlmDialect(),
    "mimo": MimoDialect(),
    "flint": FlintJsonDialect(),
    "deepseek_v4": deepseek_dialect({"model_type": "deepseek_v4"}),
    "deepseek_v41": deepseek_dialect({"model_type": "deepseek_v41"}),
}
# What each family's model writes for get_weather(city="New York", days=3) then get_time().
REAL = {
    "qwen": "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>",
    "mimo": "<tool_call>\n<function=get_weather>\n<parameter=city>New York</parameter>\n<parameter=days>3</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    "flint": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "New York", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "deepseek_v4": '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
    'New York</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
    "deepseek_v41": '<｜DSML｜ tool_calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">'
    'New York</｜DSML｜ parameter>\n<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    '</｜DSML｜ invoke>\n<｜DSML｜ invoke name="get_time">\n</｜DSML｜ invoke>\n</｜DSML｜ tool_calls>',
}
EXPECTED = [("get_weather", {"city": "New York", "days": 3}), ("get_time", {})]
FAMILIES = sorted(DIALECTS)


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def stream_all(dialect, text, pieces, tools=TOOLS):
    stream = dialect.stream(tools, request_tag=7)
    deltas = []
    for piece in pieces:
        deltas += stream.push(piece)
    return deltas + stream.finish()


def random_pieces(text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("family", FAMILIES)
def test_real_syntax_parses(family):
    parsed = DIALECTS[family].parse("Let me check.\n\n" + REAL[family], TOOLS, request_tag=7)
    assert calls_of(parsed) == EXPECTED
    assert parsed.content == "Let me check."
    assert [c.id for c in parsed.tool_calls] == [call_id(7, 0), call_id(7, 1)]
    only_calls = DIALECTS[family].parse(REAL[family], TOOLS)
    assert only_calls.content is None and len(only_calls.tool_calls) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_format_round_trips(family):
    d = DIALECTS[family]
    calls = [("get_weather", {"city": "São Paulo </x> 1", "days": 2}), ("get_time", {})]
    assert calls_of(d.parse(d.format_calls(calls), TOOLS)) == calls
    assert d.parse(REAL[family], TOOLS).tool_calls == d.parse(d.format_calls(EXPECTED), TOOLS).tool_calls


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(6))
def test_streaming_equals_one_shot(family, seed):
    d = DIALECTS[family]
    text = "Sure, 你好 😀.\n" + REAL[family] + "\n"
    one_shot = d.parse(text, TOOLS, request_tag=7)
    deltas = stream_all(d, text, random_pieces(text, seed) if seed else list(text))
    calls = [x["tool_calls"][0] for x in deltas if "tool_calls" in x]
    assert len(calls) == 4  # two deltas per call
    starts, args = calls[0::2], calls[1::2]
    assert [s["function"]["name"] for s in starts] == ["get_weather", "get_time"]
    assert all(
        s["function"]["arguments"] == "" and s["id"].startswith("call_") and len(s["id"]) == 21
        for s in starts
    )
    assert [json.loads(a["function"]["arguments"]) for a in args] == [e[1] for e in EXPECTED]
    assert "".join(x.get("content", "") for x in deltas) == one_shot.content == "Sure, 你好 😀."


@pytest.mark.parametrize("family", FAMILIES)
def test_malformed_output_is_text(family):
    d = DIALECTS[family]
    start = d.markers[0][0]
    broken = [
        REAL[family][: len(REAL[family]) // 2],  # cut off mid-call
        start + "garbage that is not a call" + d.markers[0][1],
        d.format_calls([("launch_rockets", {"when": "now"})]),  # a tool the request does not offer
    ]
    if family.startswith("deepseek"):
        broken.append(REAL[family].replace('string="false">3', 'string="false">{not json'))
    else:  # one good block, one bad: the good call is kept, the bad block stays text
        mixed = d.parse(d.format_calls([("get_time", {})]) + "\n" + d.format_calls([("nope", {})]), TOOLS)
        assert [c.name for c in mixed.tool_calls] == ["get_time"] and mixed.content == d.format_calls(
            [("nope", {})]
        )
    for text in broken:
        parsed = d.parse("pre " + text, TOOLS)
        assert parsed.tool_calls == []
        assert parsed.content == "pre " + text
        streamed = stream_all(d, "pre " + text, list("pre " + text))
        assert "".join(x.get("content", "") for x in streamed) == "pre " + text


@pytest.mark.parametrize("family", FAMILIES)
def test_marker_prefix_is_held_then_released(family):
    d = DIALECTS[family]
    start = d.markers[0][0]
    stream = d.stream(TOOLS)
    out = stream.push("a " + start[:3])
    assert "".join(x.get("content", "") for x in out) == "a"
    out += stream.push("zz") + stream.finish()
    assert "".join(x.get("content", "") for x in out) == "a " + start[:3] + "zz"


def test_string_schema_keeps_text_and_typed_values_become_json():
    d = DIALECTS["qwen"]
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>"
    assert calls_of(d.parse(text, TOOLS)) == [("get_weather", {"city": "42", "days": "soon"})]


def test_mimo_keeps_values_exactly_as_written_qwen_drops_its_padding():
    """MiMo's template tells the model a value is kept as written, spaces and line breaks included; Qwen pads
    each value with one newline on both sides, which is layout, not value."""
    code = "  def f():\n      return 1\n"
    mimo = (
        f"<tool_call>\n<function=get_weather>\n<parameter=city>{code}</parameter>\n</function>\n</tool_call>"
    )
    assert calls_of(DIALECTS["mimo"].parse(mimo, TOOLS)) == [("get_weather", {"city": code})]
    qwen = f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{code}\n</parameter>\n</function>\n</tool_call>"
    assert calls_of(DIALECTS["qwen"].parse(qwen, TOOLS)) == [("get_weather", {"city": code})]
    assert DIALECTS["mimo"].format_calls([("get_weather", {"city": code})]) == mimo


def test_custom_tool_call_is_reported_custom():
    tools = tool_specs([{"type": "custom", "custom": {"name": "shell"}}])
    parsed = DIALECTS["qwen"].parse(
        "<tool_call>\n<function=shell>\n<parameter=input>\nls -la\n</parameter>\n</function>\n</tool_call>",
        tools,
    )
    call = parsed.tool_calls[0]
    assert call.as_openai()["custom"] == {"name": "shell", "input": "ls -la"}
    assert call.stream_deltas()[1]["tool_calls"][0]["custom"] == {"input": "ls -la"}


@pytest.mark.parametrize("family", ["qwen", "glm", "deepseek", "mimo", "flint"])
def test_plugins_return_their_dialect_and_template(family):
    pm = build_manager()
    cfg = {"model_type": {"deepseek": "deepseek_v41"}.get(family, family)}
    assert pm.hook.dgpp_tool_dialect(family=family, hf_config=cfg) is not None
    assert "{%" in pm.hook.dgpp_chat_template(family=family, hf_config=cfg)
