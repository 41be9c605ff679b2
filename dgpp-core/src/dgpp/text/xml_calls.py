"""The Qwen-XML function syntax (``<function=NAME>`` + ``<parameter=KEY>``), shared by the dialects that
use it (Qwen writes it with newlines, MiMo compactly); parsing accepts both layouts."""

from __future__ import annotations

import json
import re
from typing import Any

from dgpp.text.dialect import Dialect, coerce_value
from dgpp.text.lark import LarkBuilder
from dgpp.text.tools import ToolSpec

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# A parameter ends at its close tag; a missing close tag (seen in real output) ends at the next parameter.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def value_text(value: Any) -> str:
    """How an argument is written: strings bare, everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def whole_matches(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """Every match of ``pattern`` in ``text``, or None when anything but whitespace stands between or around them.

    Tag-structured call syntaxes (this one, DeepSeek's DSML) accept a block only when it is nothing but
    their elements: stray text means the model did not write a call, and it stays text.
    """
    found: list[re.Match[str]] = []
    pos = 0
    for match in pattern.finditer(text):
        if text[pos : match.start()].strip():
            return None
        found.append(match)
        pos = match.end()
    return None if text[pos:].strip() else found


def parse_functions(inner: str, tools: dict[str, ToolSpec], coerce) -> list[tuple[str, dict]] | None:
    """The ``<function=...>`` elements of one block; None when anything else but whitespace is in it."""
    functions = whole_matches(_FUNCTION, inner)
    if functions is None:
        return None
    calls: list[tuple[str, dict]] = []
    for fn in functions:
        name, body = fn.group(1).strip(), fn.group(2)
        params = whole_matches(_PARAMETER, body)
        if params is None:
            return None
        args: dict[str, Any] = {}
        for par in params:
            raw = par.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = par.group(1).strip()
            args[key] = coerce(raw, tools.get(name), key)
        calls.append((name, args))
    return calls or None


def format_function(name: str, args: dict, compact: bool) -> str:
    nl = "" if compact else "\n"
    params = "".join(f"<parameter={k}>{nl}{value_text(v)}{nl}</parameter>{nl}" for k, v in args.items())
    return f"<function={name}>{nl}{params}</function>{nl}"


def function_grammar(dialect: Any, spec: ToolSpec, g: LarkBuilder, compact: bool) -> str:
    """Lark for one ``<function=...>`` element as ``format_function`` writes it."""
    nl = "" if compact else "\n"

    def one_argument(key: str) -> str:
        return f"{g.lit(f'<parameter={key}>{nl}')} {dialect.value_grammar(spec, key, f'{nl}</parameter>{nl}', g)}"

    args = dialect.arguments_grammar(spec, one_argument, g)
    return f"{g.lit(f'<function={spec.name}>{nl}')} {args} {g.lit(f'</function>{nl}')}"


class XmlFunctionDialect(Dialect):
    """Calls as ``<tool_call>`` blocks holding one ``<function=...>`` each; ``compact`` drops the newlines."""

    name = "xml-function"
    markers = (("<tool_call>", "</tool_call>"),)
    compact = False

    def parse_block(self, inner: str, tools: dict[str, ToolSpec]) -> list[tuple[str, dict]] | None:
        return parse_functions(inner, tools, coerce_value)

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        nl = "" if self.compact else "\n"
        return nl.join(f"<tool_call>{nl}{format_function(n, a, self.compact)}</tool_call>" for n, a in calls)

    def call_grammar(self, spec: ToolSpec, g: LarkBuilder) -> str:
        nl = "" if self.compact else "\n"
        body = function_grammar(self, spec, g, self.compact)
        return f"{g.lit('<tool_call>' + nl)} {body} {g.lit('</tool_call>')}"

    def calls_grammar(self, one_call: str, parallel: bool, g: LarkBuilder) -> str:
        sep = g.lit("" if self.compact else "\n")
        return one_call if not parallel else f"{one_call} ({sep} {one_call})*"
