"""Tool-call dialects: a family's call syntax, parsed from complete output and from streamed increments.

A dialect says where a call block starts and ends (``markers``) and how to read one block
(``parse_block``); this base does the rest: content outside blocks, two streamed deltas per
call (a start delta with id, type and name, then one delta with the complete arguments), deterministic
call ids, argument typing from the tool's schema. Malformed blocks come back as content, never as errors.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dgpp.splitmix import MASK64, splitmix64
from dgpp.text.detokenizer import held_prefix_length
from dgpp.text.effort import SWITCH_ONLY, EffortMapping
from dgpp.text.lark import LarkBuilder
from dgpp.text.string_schema import string_value_regex
from dgpp.text.tools import ToolSpec


def call_id(request_tag: int | str, index: int) -> str:
    """``call_`` + 16 hex digits, a SplitMix64 hash of (request tag, call index): unique and repeatable."""
    if isinstance(request_tag, str):
        request_tag = int.from_bytes(hashlib.blake2b(request_tag.encode(), digest_size=8).digest(), "little")
    return f"call_{splitmix64(splitmix64(request_tag & MASK64) ^ index):016x}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is the JSON object text OpenAI clients receive."""

    name: str
    arguments: str
    id: str
    index: int
    custom: bool = False

    def as_openai(self) -> dict[str, Any]:
        if self.custom:
            return {
                "id": self.id,
                "type": "custom",
                "custom": {"name": self.name, "input": self.input_text()},
            }
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def input_text(self) -> str:
        return str(json.loads(self.arguments).get("input", ""))

    def stream_deltas(self) -> list[dict[str, Any]]:
        """The two streamed deltas of this call: a start delta (id, type, name), then the whole arguments."""
        if self.custom:
            start = {
                "index": self.index,
                "id": self.id,
                "type": "custom",
                "custom": {"name": self.name, "input": ""},
            }
            rest = {"index": self.index, "custom": {"input": self.input_text()}}
        else:
            start = {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": ""},
            }
            rest = {"index": self.index, "function": {"arguments": self.arguments}}
        return [{"tool_calls": [start]}, {"tool_calls": [rest]}]


@dataclass
class ParsedOutput:
    """Complete output split into visible content (None when it was only calls) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def coerce_value(raw: str, spec: ToolSpec | None, key: str) -> Any:
    """An argument written as bare text: a string when the schema says string (or says nothing), else JSON."""
    kind = spec.param_type(key) if spec is not None else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds & {"string", None}:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # the model wrote a non-JSON value for a typed argument: keep its text


class Dialect(ABC):
    """A family's tool-call syntax plus its reasoning tags and reasoning-effort mapping.

    Subclasses set ``name`` and ``markers`` (pairs of block start / end text) and implement
    ``parse_block`` (the text between the markers -> ``[(name, arguments dict)]``, or None when malformed)
    and ``format_calls`` (the canonical text of calls, used by templates' tests and grammars).
    """

    name: str = "dialect"
    markers: tuple[tuple[str, str], ...] = ()
    think_start: str = "<think>"
    think_end: str = "</think>"
    effort: EffortMapping = SWITCH_ONLY

    @abstractmethod
    def parse_block(self, inner: str, tools: dict[str, ToolSpec]) -> list[tuple[str, dict]] | None:
        """Read the calls inside one block (``inner`` excludes the markers); None when it is malformed."""

    @abstractmethod
    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        """The text a model of this family writes for ``calls`` (one complete block or several)."""

    @abstractmethod
    def call_grammar(self, spec: ToolSpec, g: LarkBuilder) -> str:
        """A Lark expression for one call of ``spec`` written the way ``format_calls`` writes it."""

    def calls_grammar(self, one_call: str, parallel: bool, g: LarkBuilder) -> str:
        """One call, or (``parallel``) one or more; the default puts one block per call, newline-separated."""
        return one_call if not parallel else f'{one_call} ("\\n" {one_call})*'

    def value_grammar(self, spec: ToolSpec, key: str, end: str, g: LarkBuilder) -> str:
        """An argument value followed by ``end``: raw text for strings (how these dialects write them), a
        literal choice for string enums/consts, else an embedded JSON value."""
        prop = (spec.parameters.get("properties") or {}).get(key)
        prop = prop if isinstance(prop, dict) else {}
        if spec.custom and spec.grammar is not None:
            return f"{spec.grammar_expression(g)} {g.lit(end)}"
        if prop.get("type") == "string" or (spec.custom and key == "input"):
            choices = [prop["const"]] if "const" in prop else prop.get("enum")
            if choices and all(isinstance(c, str) for c in choices):
                return "(" + " | ".join(g.lit(c) for c in choices) + ") " + g.lit(end)
            # a strict tool's pattern / length limits hold for the bare text (non-strict ones stay lenient)
            regex = string_value_regex(prop, f"tool {spec.name!r} argument {key!r}") if spec.strict else None
            if regex is not None:
                return g.text_until(end, f"{spec.name}_{key}", regex)
            return g.text_until(end, f"{spec.name}_{key}")
        return f"{g.json(prop or {}, lenient=not spec.strict)} {g.lit(end)}"

    def arguments_grammar(self, spec: ToolSpec, one_argument, g: LarkBuilder) -> str:
        """The arguments of ``spec`` in schema order; optional ones may be left out."""
        props = list((spec.parameters.get("properties") or {}).keys())
        required = set(spec.parameters.get("required") or []) | ({"input"} if spec.custom else set())
        parts = []
        for key in props:
            expr = one_argument(key)
            parts.append(expr if key in required or spec.strict else f"({expr})?")
        return " ".join(parts) if parts else '""'

    def parse(
        self, text: str, tools: list[ToolSpec] | None = None, request_tag: int | str = 0
    ) -> ParsedOutput:
        """Parse complete output (same result as streaming it)."""
        stream = self.stream(tools, request_tag)
        deltas = stream.push(text) + stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        return ParsedOutput(content if content or not stream.calls else None, list(stream.calls))

    def stream(self, tools: list[ToolSpec] | None = None, request_tag: int | str = 0) -> ToolCallStream:
        return ToolCallStream(self, tools, request_tag)

    def _checked_calls(
        self, inner: str, tools: dict[str, ToolSpec]
    ) -> list[tuple[str, dict, ToolSpec | None]] | None:
        try:
            calls = self.parse_block(inner, tools)
        except (ValueError, KeyError, IndexError, TypeError):
            return None  # a parser surprise on odd output is malformed output, not a server error
        if not calls:
            return None
        out = []
        for name, args in calls:
            if tools and name not in tools:
                return None  # a call to a tool the request does not offer
            if not isinstance(args, dict):
                return None
            out.append((name, args, tools.get(name)))
        return out


class ToolCallStream:
    """One request's incremental parser: ``push(text)`` -> OpenAI deltas (``{"content"}`` or ``{"tool_calls"}``)."""

    def __init__(self, dialect: Dialect, tools: Iterable[ToolSpec] | None, request_tag: int | str) -> None:
        self.dialect = dialect
        self.tools = {t.name: t for t in tools or ()}
        self.request_tag = request_tag
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._open: tuple[str, str] | None = None  # the markers of the block being read
        self._starts = tuple(start for start, _ in dialect.markers)
        self._pending_ws = ""  # trailing whitespace of content, held until it is known not to precede a call
        self._after_call = False

    @property
    def holding(self) -> bool:
        """True while text is held back because it is, or may start, a call block (not yet content or calls)."""
        return self._open is not None or bool(self._buf)

    def push(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self._open is None:
                hit = self._first_start()
                if hit is None:
                    keep = held_prefix_length(self._buf, self._starts)
                    emit, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                    self._content(emit, out)
                    return out
                at, pair = hit
                self._content(self._buf[:at], out)
                self._buf, self._open = self._buf[at:], pair
            start, end = self._open
            close = self._buf.find(end, len(start))
            if close < 0:
                return out
            block, self._buf = self._buf[: close + len(end)], self._buf[close + len(end) :]
            self._open = None
            self._block(block, block[len(start) : close], out)

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is not None:  # output ended inside a block: accept it only if it parses without its end
            start, _ = self._open
            block, self._buf, self._open = self._buf, "", None
            self._block(block, block[len(start) :], out)
        self._content(self._buf, out, at_end=True)
        self._buf = ""
        return out

    def _first_start(self) -> tuple[int, tuple[str, str]] | None:
        best = None
        for pair in self.dialect.markers:
            at = self._buf.find(pair[0])
            if at >= 0 and (best is None or at < best[0]):
                best = (at, pair)
        return best

    def _block(self, block: str, inner: str, out: list[dict[str, Any]]) -> None:
        calls = self.dialect._checked_calls(inner, self.tools)
        if calls is None:
            out.append({"content": self._pending_ws + block})
            self._pending_ws, self._after_call = "", False
            return
        self._pending_ws, self._after_call = "", True  # whitespace around call blocks only separates them
        for name, args, spec in calls:
            index = len(self.calls)
            call = ToolCall(
                name,
                json.dumps(args, ensure_ascii=False),
                call_id(self.request_tag, index),
                index,
                custom=bool(spec and spec.custom),
            )
            self.calls.append(call)
            out.extend(call.stream_deltas())

    def _content(self, text: str, out: list[dict[str, Any]], at_end: bool = False) -> None:
        """Emit content, holding back trailing whitespace until it is known not to just precede a call."""
        text = self._pending_ws + text
        self._pending_ws = ""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if at_end:
            if text and (text.strip() or not self.calls):
                out.append({"content": text})
            return
        body = text.rstrip()
        if body:
            out.append({"content": body})
        self._pending_ws = text[len(body) :]
