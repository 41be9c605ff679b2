"""DeepSeek's tool-call dialect (DSML) for V4 and V4.1, reasoning-effort mappings, and the chat template.

Calls are one block of invokes::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` values are bare text, ``string="false"`` values JSON. V4.1 writes a space after
``｜DSML｜`` in every tag (``<｜DSML｜ invoke …>``), V4 none; the parser accepts both, and
the older ``function_calls`` block name. Effort: V4.1 none -> chat mode, minimal…max -> native
budgets 25/50/62/75/100/100; V4 passes the effort as its name.

DeepSeek-V4 checkpoints ship no Jinja template (their renderer is Python), so ``chat_template.jinja``
here is authored in-repo from those facts; ``@DSML@`` in it stands for the variant's tag prefix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dgpp.plugin_api import Dialect
from dgpp.text.effort import EffortMapping
from dgpp.text.lark import LarkBuilder
from dgpp.text.tools import ToolSpec
from dgpp.text.xml_calls import value_text, whole_matches

TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")
V41_EFFORT = EffortMapping({"minimal": 25, "low": 50, "medium": 62, "high": 75, "xhigh": 100, "max": 100})
V4_EFFORT = EffortMapping({e: e for e in ("minimal", "low", "medium", "high", "xhigh", "max")})
_BAR = "｜DSML｜"
_INVOKE = re.compile(rf'<{_BAR} ?invoke name="([^"]+)">(.*?)</{_BAR} ?invoke>', re.S)
_PARAM = re.compile(
    rf'<{_BAR} ?parameter name="([^"]+)" string="(true|false)">(.*?)</{_BAR} ?parameter>', re.S
)


class DsmlDialect(Dialect):
    """DSML tool calls; ``space`` is "" for V4 and " " for V4.1."""

    name = "deepseek-dsml"

    def __init__(self, space: str = "", effort: EffortMapping = V4_EFFORT) -> None:
        self.space = space
        self.effort = effort
        self.tag = f"{_BAR}{space}"
        self.markers = tuple(
            (f"<{_BAR}{sp}{block}>", f"</{_BAR}{sp}{block}>")
            for sp in (space, " " if not space else "")
            for block in ("tool_calls", "function_calls")
        )

    def parse_block(self, inner: str, tools: dict[str, ToolSpec]) -> list[tuple[str, dict[str, Any]]] | None:
        invokes = whole_matches(_INVOKE, inner)
        if invokes is None:
            return None
        calls = []
        for inv in invokes:
            params = whole_matches(_PARAM, inv.group(2))
            if params is None:
                return None
            args = {
                par.group(1): par.group(3) if par.group(2) == "true" else json.loads(par.group(3))
                for par in params
            }
            calls.append((inv.group(1), args))
        return calls or None

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        t = self.tag
        out = [f"<{t}tool_calls>\n"]
        for name, args in calls:
            out.append(f'<{t}invoke name="{name}">\n')
            for k, v in args.items():
                out.append(
                    f'<{t}parameter name="{k}" string="{str(isinstance(v, str)).lower()}">{value_text(v)}</{t}parameter>\n'
                )
            out.append(f"</{t}invoke>\n")
        out.append(f"</{t}tool_calls>")
        return "".join(out)

    def call_grammar(self, spec: ToolSpec, g: LarkBuilder) -> str:
        t = self.tag
        end = f"</{t}parameter>\n"
        props = spec.parameters.get("properties") or {}

        def one_argument(key: str) -> str:
            entry = props.get(key)
            prop = entry if isinstance(entry, dict) else {}
            as_text = prop.get("type") == "string" or (spec.custom and key == "input")
            opener = g.lit(f'<{t}parameter name="{key}" string="{str(as_text).lower()}">')
            return f"{opener} {self.value_grammar(spec, key, end, g)}"

        args = self.arguments_grammar(spec, one_argument, g)
        return f"{g.lit(f'<{t}invoke name=' + json.dumps(spec.name) + '>' + chr(10))} {args} {g.lit(f'</{t}invoke>' + chr(10))}"

    def calls_grammar(self, one_call: str, parallel: bool, g: LarkBuilder) -> str:
        calls = one_call if not parallel else f"{one_call}+"
        return f"{g.lit(f'<{self.tag}tool_calls>' + chr(10))} {calls} {g.lit(f'</{self.tag}tool_calls>')}"


def dialect_for(hf_config: dict[str, Any]) -> DsmlDialect:
    """V4.1 (``deepseek_v41``) writes the spaced tags and takes numeric budgets; V4 the plain ones."""
    is_v41 = hf_config.get("model_type") == "deepseek_v41" or any(
        "V41" in a for a in hf_config.get("architectures") or []
    )
    return DsmlDialect(" ", V41_EFFORT) if is_v41 else DsmlDialect("", V4_EFFORT)


def chat_template(hf_config: dict[str, Any]) -> str:
    """The in-repo DeepSeek-V4-style template with the variant's DSML tag prefix filled in."""
    return TEMPLATE_FILE.read_text(encoding="utf-8").replace("@DSML@", dialect_for(hf_config).tag)
