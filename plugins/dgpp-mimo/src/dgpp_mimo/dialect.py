"""MiMo's tool-call dialect and its chat template.

A call is ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>VALUE</parameter>\\n</function>\\n</tool_call>``: the
Qwen-XML function syntax with every tag on its own line, but each value written exactly as it stands between its
tags (strings bare, other values JSON): MiMo's template tells the model whitespace inside a value is kept, so the
parser keeps it too (Qwen's pads values with newlines and drops the padding). Parallel calls are consecutive
blocks. Thinking sits in ``<think>...</think>``; the model opens ``<think>`` itself when thinking is on, and the
template has only a switch (``enable_thinking``), so efforts map as switch-only. A checkpoint's own
``chat_template`` wins; ``chat_template.jinja`` here is the fallback, off by default as MiMo-V2-Flash's is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dgpp.text.effort import SWITCH_ONLY
from dgpp.text.xml_calls import XmlFunctionDialect

TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")


class MimoDialect(XmlFunctionDialect):
    """Qwen-XML tool calls with values kept exactly as written."""

    name = "mimo-xml"
    effort = SWITCH_ONLY
    padded_values = False


def dialect_for(hf_config: dict[str, Any]) -> MimoDialect:
    return MimoDialect()


def chat_template(hf_config: dict[str, Any] | None = None) -> str:
    """The in-repo MiMo template, for checkpoints that ship none."""
    return TEMPLATE_FILE.read_text(encoding="utf-8")
