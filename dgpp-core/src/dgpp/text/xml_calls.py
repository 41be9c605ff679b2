"""The Qwen-XML function syntax (``<function=NAME>`` + ``<parameter=KEY>``), shared by the dialects that
use it. Qwen puts every tag on its own line and pads each value with a newline on both sides (the parser
drops that padding); MiMo puts the tags on their own lines but writes each value exactly as it is between its
tags (whitespace included, so nothing is stripped). Parsing accepts any whitespace between tags."""

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
_NL = "\n"
_CLOSE_PARAMETER, _CLOSE_FUNCTION = "</parameter>\n", "</function>\n"


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


def parse_functions(
    inner: str, tools: dict[str, ToolSpec], coerce, padded: bool = True
) -> list[tuple[str, dict]] | None:
    """The ``<function=...>`` elements of one block; None when anything else but whitespace is in it.
    ``padded``: drop one newline at each end of a value (the writer's padding, not the value's)."""
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
            if padded:
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
            key = par.group(1).strip()
            args[key] = coerce(raw, tools.get(name), key)
        calls.append((name, args))
    return calls or None


def format_function(name: str, args: dict, padded: bool = True) -> str:
    pad = "\n" if padded else ""
    params = "".join(f"<parameter={k}>{pad}{value_text(v)}{pad}</parameter>\n" for k, v in args.items())
    return f"<function={name}>\n{params}</function>\n"


def function_grammar(dialect: Any, spec: ToolSpec, g: LarkBuilder, padded: bool = True) -> str:
    """Lark for one ``<function=...>`` element as ``format_function`` writes it."""
    pad = "\n" if padded else ""

    def one_argument(key: str) -> str:
        return f"{g.lit(f'<parameter={key}>{pad}')} {dialect.value_grammar(spec, key, pad + _CLOSE_PARAMETER, g)}"

    args = dialect.arguments_grammar(spec, one_argument, g)
    return f"{g.lit(f'<function={spec.name}>' + _NL)} {args} {g.lit(_CLOSE_FUNCTION)}"


class XmlFunctionDialect(Dialect):
    """Calls as ``<tool_call>`` blocks holding one ``<function=...>`` each, every tag on its own line, blocks
    separated by a newline; ``padded_values`` (Qwen) pads each value with newlines, off (MiMo) writes and reads
    values exactly as they stand between their tags."""

    name = "xml-function"
    markers = (("<tool_call>", "</tool_call>"),)
    padded_values = True

    def parse_block(self, inner: str, tools: dict[str, ToolSpec]) -> list[tuple[str, dict]] | None:
        return parse_functions(inner, tools, coerce_value, self.padded_values)

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(
            f"<tool_call>\n{format_function(n, a, self.padded_values)}</tool_call>" for n, a in calls
        )

    def call_grammar(self, spec: ToolSpec, g: LarkBuilder) -> str:
        body = function_grammar(self, spec, g, self.padded_values)
        return f"{g.lit('<tool_call>' + _NL)} {body} {g.lit('</tool_call>')}"
