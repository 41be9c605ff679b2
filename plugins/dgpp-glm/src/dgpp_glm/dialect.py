"""GLM's tool-call dialect (GLM-4.x markers) and reasoning-effort mapping, plus its chat template.

A call is ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n…</tool_call>``: string
values bare, others JSON; parallel calls are consecutive blocks; the compact layout without newlines
(GLM-4.7) parses too. Thinking sits in ``<think>…</think>``. Effort: minimal/low -> low,
medium/high -> high, xhigh/max -> max; none only through the thinking switch.

No GLM tokenizer or chat template is published on a package registry, so ``chat_template.jinja`` here is
authored in-repo in the GLM-4.x style from these facts (``[gMASK]<sop>``, ``<|system|>``/``<|user|>``/
``<|assistant|>``/``<|observation|>`` turns, ``<tool_response>`` results, ``/nothink``-free thinking switch).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dgpp.plugin_api import Dialect
from dgpp.text.dialect import coerce_value
from dgpp.text.effort import EffortMapping
from dgpp.text.lark import LarkBuilder
from dgpp.text.tools import ToolSpec
from dgpp.text.xml_calls import value_text

TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")
GLM_EFFORT = EffortMapping(
    {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
)
_NAME = re.compile(r"\s*([^\s<>]+)\s*")
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GlmDialect(Dialect):
    """GLM-4.x ``<arg_key>``/``<arg_value>`` tool calls."""

    name = "glm-markers"
    markers = (("<tool_call>", "</tool_call>"),)
    effort = GLM_EFFORT

    def parse_block(self, inner: str, tools: dict[str, ToolSpec]) -> list[tuple[str, dict[str, Any]]] | None:
        head = _NAME.match(inner)
        if head is None:
            return None
        name, pos, args = head.group(1), head.end(), {}
        while pos < len(inner) and inner[pos:].strip():
            pair = _PAIR.match(inner, pos)
            if pair is None:
                return None
            key = pair.group(1).strip()
            args[key] = coerce_value(pair.group(2), tools.get(name), key)
            pos = pair.end()
        return [(name, args)]

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        blocks = []
        for name, args in calls:
            pairs = "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{value_text(v)}</arg_value>\n" for k, v in args.items()
            )
            blocks.append(f"<tool_call>{name}\n{pairs}</tool_call>")
        return "\n".join(blocks)

    def call_grammar(self, spec: ToolSpec, g: LarkBuilder) -> str:
        def one_argument(key: str) -> str:
            opener = g.lit(f"<arg_key>{key}</arg_key>\n<arg_value>")
            return f"{opener} {self.value_grammar(spec, key, '</arg_value>' + chr(10), g)}"

        args = self.arguments_grammar(spec, one_argument, g)
        return f"{g.lit(f'<tool_call>{spec.name}' + chr(10))} {args} {g.lit('</tool_call>')}"


def dialect_for(hf_config: dict[str, Any]) -> GlmDialect:
    return GlmDialect()


def chat_template(hf_config: dict[str, Any] | None = None) -> str:
    """The in-repo GLM-4.x-style template (no published GLM template exists to ship)."""
    return TEMPLATE_FILE.read_text(encoding="utf-8")
