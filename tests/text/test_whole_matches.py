"""whole_matches: the strict "nothing but these elements" scan shared by the tag-structured call syntaxes."""

from __future__ import annotations

import re

from dgpp.text.xml_calls import parse_functions, whole_matches
from dgpp_deepseek.dialect import DsmlDialect

_TAG = re.compile(r"<t>(.*?)</t>", re.S)


def test_whitespace_only_between_and_around():
    found = whole_matches(_TAG, " \n<t>a</t>\n <t>b</t>\t")
    assert [m.group(1) for m in found] == ["a", "b"]
    assert whole_matches(_TAG, "") == []
    assert whole_matches(_TAG, "   ") == []


def test_stray_text_anywhere_rejects_the_block():
    assert whole_matches(_TAG, "x<t>a</t>") is None
    assert whole_matches(_TAG, "<t>a</t> x <t>b</t>") is None
    assert whole_matches(_TAG, "<t>a</t>x") is None
    assert whole_matches(_TAG, "no tags") is None


def _no_coerce(raw, tool, key):
    return raw


def test_qwen_xml_and_dsml_reject_stray_text_in_a_call_body():
    ok = "<function=f>\n<parameter=a>\n1\n</parameter>\n</function>"
    assert parse_functions(ok, {}, _no_coerce) == [("f", {"a": "1"})]
    assert parse_functions(ok.replace("</parameter>\n", "</parameter>\njunk"), {}, _no_coerce) is None
    assert parse_functions(ok + "tail", {}, _no_coerce) is None

    bar = "｜DSML｜"
    invoke = f'<{bar}invoke name="f"><{bar}parameter name="n" string="false">2</{bar}parameter></{bar}invoke>'
    dsml = DsmlDialect()
    assert dsml.parse_block(f"\n{invoke}\n", {}) == [("f", {"n": 2})]
    assert dsml.parse_block(invoke.replace("><", ">junk<", 1), {}) is None
    assert dsml.parse_block("junk" + invoke, {}) is None
