"""Qwen's tool-call dialect (Qwen XML) and reasoning-effort mapping, plus its chat template.

A call is ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``;
string values are bare text, others JSON; parallel calls are consecutive blocks. Thinking sits in
``<think>…</think>``. Effort: minimal/low -> low, medium -> medium, high/xhigh/max -> xhigh,
none -> ``enable_thinking: false``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dgpp.text.effort import EffortMapping
from dgpp.text.xml_calls import XmlFunctionDialect

TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")
QWEN_EFFORT = EffortMapping(
    {"minimal": "low", "low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh", "max": "xhigh"}
)


class QwenXmlDialect(XmlFunctionDialect):
    """Qwen3.5-style XML tool calls, written with a newline around every element."""

    name = "qwen-xml"
    effort = QWEN_EFFORT
    compact = False


def dialect_for(hf_config: dict[str, Any]) -> QwenXmlDialect:
    """Every Qwen checkpoint dgpp claims uses the same dialect."""
    return QwenXmlDialect()


def chat_template(hf_config: dict[str, Any] | None = None) -> str:
    """The in-repo Qwen3.5-style template, for checkpoints that ship none."""
    return TEMPLATE_FILE.read_text(encoding="utf-8")
