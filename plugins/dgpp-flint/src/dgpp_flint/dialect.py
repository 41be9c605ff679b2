"""Flint's tool-call dialect (JSON inside ``<tool_call>``), plus its chat template.

A call is ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``: one JSON object per block,
arguments as a JSON object (a JSON-encoded string of one is accepted too); parallel calls are consecutive
blocks. Thinking sits in ``<think>…</think>`` behind an ``enable_thinking`` switch, so efforts map as
switch-only. A checkpoint's own ``chat_template`` wins; ``chat_template.jinja`` here is authored in-repo in
the ChatML style the family's Qwen lineage uses, for checkpoints that ship none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dgpp.text.dialect import Dialect
from dgpp.text.effort import SWITCH_ONLY
from dgpp.text.lark import LarkBuilder
from dgpp.text.tools import ToolSpec

TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")


class FlintJsonDialect(Dialect):
    """``<tool_call>`` blocks each holding one ``{"name", "arguments"}`` JSON object."""

    name = "flint-json"
    markers = (("<tool_call>", "</tool_call>"),)
    effort = SWITCH_ONLY

    def parse_block(self, inner: str, tools: dict[str, ToolSpec]) -> list[tuple[str, dict[str, Any]]] | None:
        try:
            call = json.loads(inner)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        if isinstance(args, str):  # some writers encode the arguments object as a string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        return [(call["name"], args)]

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(
            f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"
            for name, args in calls
        )

    def call_grammar(self, spec: ToolSpec, g: LarkBuilder) -> str:
        head = g.lit("<tool_call>\n" + json.dumps({"name": spec.name})[:-1] + ', "arguments": ')
        if spec.custom:
            schema = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
        else:
            schema = spec.parameters or {"type": "object"}
        return f"{head} {g.json(schema, lenient=not spec.strict)} {g.lit('}' + chr(10) + '</tool_call>')}"


def dialect_for(hf_config: dict[str, Any]) -> FlintJsonDialect:
    return FlintJsonDialect()


def chat_template(hf_config: dict[str, Any] | None = None) -> str:
    """The in-repo Flint template, for checkpoints that ship none."""
    return TEMPLATE_FILE.read_text(encoding="utf-8")
