"""OpenAI tool definitions in the one shape templates, dialects and grammars read.

Every tool becomes ``{"type": "function", "function": {"name", "description"?, "parameters", "strict"?}}``.
The flat form (``{"name", "parameters", ...}``) is accepted, and a ``custom`` tool becomes a function with one
string argument ``input`` (its free-form text), marked ``custom`` so a call can be reported back in the custom shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dgpp.text.errors import TextError

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    """One callable tool: its name, JSON schema for the arguments, and whether it is strict or custom."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    description: str | None = None
    strict: bool = False
    custom: bool = False
    grammar: dict[str, Any] | None = None  # a custom tool's {"syntax": "regex"|"lark", "definition"}

    def grammar_expression(self, g: Any) -> str:
        """The custom tool's own grammar as a Lark expression (``g`` is a ``LarkBuilder``)."""
        syntax, definition = (self.grammar or {}).get("syntax"), (self.grammar or {}).get("definition", "")
        if syntax == "regex":
            return g.rule(f"{self.name}_input", "/" + definition.replace("/", "\\/") + "/")
        if syntax == "lark":
            return g.subgrammar(f"{self.name}_input", definition)
        raise TextError(
            f"custom tool {self.name!r}: grammar syntax {syntax!r} is not 'regex' or 'lark'", "tools"
        )

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        if self.strict:
            fn["strict"] = True
        return {"type": "function", "function": fn}

    def param_type(self, key: str) -> Any:
        """The JSON-schema ``type`` of argument ``key`` (None when the schema does not say)."""
        prop = (self.parameters.get("properties") or {}).get(key)
        return prop.get("type") if isinstance(prop, dict) else None


def tool_specs(tools: list[dict] | None) -> list[ToolSpec]:
    """Parse a request's ``tools`` array; bad entries raise TextError naming ``tools[i]``."""
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise TextError(f"tools[{i}] must be an object", param=f"tools[{i}]")
        kind = tool.get("type", "function")
        if kind == "custom":
            body = tool.get("custom") or {}
            name = body.get("name")
            params = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
            fmt = body.get("format") or {"type": "text"}
            fmt = fmt if isinstance(fmt, dict) else {"type": None}
            grammar = fmt.get("grammar") if fmt.get("type") == "grammar" else None
            if fmt.get("type") not in ("text", "grammar") or (
                fmt.get("type") == "grammar" and not isinstance(grammar, dict)
            ):
                raise TextError(
                    f"tools[{i}].custom.format must be text or grammar", param=f"tools[{i}].custom.format"
                )
            spec = ToolSpec(name, params, body.get("description"), strict=True, custom=True, grammar=grammar)
        elif kind == "function":
            body = tool.get("function", tool)
            name = body.get("name")
            params = body.get("parameters") or dict(EMPTY_PARAMETERS)
            spec = ToolSpec(name, params, body.get("description"), strict=bool(body.get("strict", False)))
        else:
            raise TextError(
                f"tools[{i}].type {kind!r} is not 'function' or 'custom'", param=f"tools[{i}].type"
            )
        if not isinstance(name, str) or not name:
            raise TextError(f"tools[{i}] has no function name", param=f"tools[{i}]")
        specs.append(spec)
    return specs


def template_tools(specs: list[ToolSpec]) -> list[dict] | None:
    """What chat templates receive as ``tools`` (None when there are none, as HF passes it)."""
    return [s.as_openai() for s in specs] or None
