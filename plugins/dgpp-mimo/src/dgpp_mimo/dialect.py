"""MiMo's tool-call dialect: the Qwen-XML function syntax in its compact form, plus its chat template.

A call is ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`` (string
values bare, others JSON); the parser also accepts the newline layout. Thinking sits in ``<think>…</think>``;
the template has only a thinking switch (``enable_thinking``), so efforts map as switch-only.
"""

from __future__ import annotations

from pathlib import Path

from dgpp.text.effort import SWITCH_ONLY
from dgpp.text.xml_calls import XmlFunctionDialect

TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")


class MimoDialect(XmlFunctionDialect):
    """Compact Qwen-XML tool calls."""

    name = "mimo-xml"
    effort = SWITCH_ONLY
    compact = True


def dialect_for(hf_config: dict) -> MimoDialect:
    return MimoDialect()


def chat_template(hf_config: dict | None = None) -> str:
    """The in-repo MiMo-style template, for checkpoints that ship none."""
    return TEMPLATE_FILE.read_text(encoding="utf-8")
