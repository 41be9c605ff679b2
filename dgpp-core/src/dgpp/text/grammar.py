"""Constrained decoding with llguidance: response_format JSON (schema or any object), tool_choice
required / named / allowed_tools in the family's own call syntax, strict schemas, parallel_tool_calls.

Why llguidance (not xgrammar): its Lark grammars embed JSON schemas (``%json``) and
lazy text (``[suffix=...]``), which is exactly what the families' call syntaxes need (bare-text string
arguments inside XML / DSML / GLM markers, typed arguments as JSON), and custom tools' own Lark and
regex grammars plug in as they are; masks cost ~0.05-0.2 ms per token on a 129k vocabulary.
"""

from __future__ import annotations

from typing import Any

import llguidance
import numpy as np
import torch

from dgpp.text.errors import GrammarError
from dgpp.text.lark import LarkBuilder
from dgpp.text.schema_keywords import unenforced_keyword
from dgpp.text.tokenizer import Tokenizer
from dgpp.text.tools import ToolSpec, tool_specs


class GrammarContext:
    """Per model: the llguidance view of the tokenizer (about a second to build for a 129k vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        eos = min(self.eos_ids) if self.eos_ids else None
        self.lltok = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
        )
        # llguidance decides itself which added tokens are special (never matched by literal text), e.g.
        # DeepSeek's </think> although tokenizer.json does not mark it; grammars must name those by id.
        added = tokenizer.backend.get_added_tokens_decoder()
        self.specials = {tok.content: tid for tid, tok in added.items() if self.lltok.is_special_token(tid)}

    def builder(self) -> LarkBuilder:
        return LarkBuilder(self.specials)


class GrammarMatcher:
    """One request's constraint, driven by the sampler: ``mask`` before sampling, ``accept`` after.

    EOS ids are allowed only once the structure is complete; after that nothing but EOS is allowed.
    ``warnings`` lists what was relaxed (a non-strict schema that fell back to any JSON object).
    """

    def __init__(
        self,
        ctx: GrammarContext,
        grammar: str,
        warnings: list[str] | None = None,
        param: str = "response_format",
    ) -> None:
        self.ctx = ctx
        self.grammar = grammar
        self.warnings = list(warnings or [])
        self._m = llguidance.LLMatcher(ctx.lltok, grammar)
        if self._m.is_error():
            raise GrammarError(f"cannot compile the constraint: {self._m.get_error()}", param)
        self._done = False

    def mask(self, vocab_size: int) -> torch.Tensor:
        """Allowed next tokens as a bool tensor of ``vocab_size`` (ids past the tokenizer are never allowed)."""
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        if self._done:
            return allowed
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        n = min(vocab_size, self.ctx.vocab_size)
        allowed[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        accepting = self._m.is_accepting()
        for eos in self.ctx.eos_ids:
            if eos < vocab_size:
                allowed[eos] = accepting
        return allowed

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the token was not allowed (the matcher is then unusable)."""
        if self._done:
            return False
        if token_id in self.ctx.eos_ids:
            if self._m.is_accepting():
                self._done = True
                return True
            return False
        return bool(self._m.consume_token(token_id))

    def is_done(self) -> bool:
        """True once EOS was accepted, or when the structure is complete and nothing but EOS may follow."""
        return self._done or self._m.is_stopped()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""
        if num_tokens and self._done:
            self._done = False
            num_tokens -= 1
        if num_tokens and not self._m.rollback(num_tokens):
            raise GrammarError(f"cannot roll the constraint back by {num_tokens} tokens")


# --- building from a request -----------------------------------------------------------------------------------------


def _json_format(fmt: dict, g: LarkBuilder) -> str:
    kind = fmt.get("type")
    if kind == "json_object":
        return g.json({"type": "object"})
    if kind != "json_schema":
        raise GrammarError(
            f"response_format.type {kind!r} is not text, json_object or json_schema", "response_format.type"
        )
    spec = fmt.get("json_schema") or {}
    if not isinstance(spec, dict):
        raise GrammarError("response_format.json_schema must be an object", "response_format.json_schema")
    schema = spec.get("schema", {})  # OpenAI's schema is optional: none constrains to any JSON value
    if not isinstance(schema, dict):
        raise GrammarError(
            "response_format.json_schema.schema must be an object", "response_format.json_schema.schema"
        )
    refuse_unenforced(schema, "response_format.json_schema.schema")
    alone = LarkBuilder({})
    problem = llguidance.LLMatcher.validate_grammar(alone.grammar(alone.json(schema)))
    if (
        problem
    ):  # invalid, or a keyword llguidance would ignore (a WARNING): refused, strict or not, as OpenAI
        raise GrammarError(
            f"response_format.json_schema.schema cannot be enforced: {problem.strip()}",
            "response_format.json_schema.schema",
        )
    return g.json(schema)


def refuse_unenforced(schema: Any, param: str, what: str | None = None) -> None:
    """400 naming the first keyword of ``schema`` the backend would silently ignore (``dgpp.text.schema_keywords``)."""
    found = unenforced_keyword(schema)
    if found is not None:
        keyword, where = found
        raise GrammarError(
            f"{what or param} uses {keyword!r} (at {where}), which structured output cannot "
            "enforce; remove it or describe the constraint in the prompt",
            param,
        )


def _strict_tool_schemas(specs: list[ToolSpec]) -> None:
    """A strict tool's arguments are constrained to its schema, so they must be enforceable (non-strict tools are
    compiled leniently: their schema guides, as OpenAI documents for them)."""
    for spec in specs:
        if spec.strict and not spec.custom:
            refuse_unenforced(spec.parameters, "tools", f"strict tool {spec.name!r}: parameters")


def _named_tools(choice: Any, specs: list[ToolSpec]) -> tuple[list[ToolSpec], bool] | None:
    """(tools that may be called, whether a call is required) for ``tool_choice``; None = unconstrained."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return specs, True
    if not isinstance(choice, dict):
        raise GrammarError(f"tool_choice {choice!r} is not auto, none, required or an object", "tool_choice")
    by_name = {s.name: s for s in specs}
    kind = choice.get("type")
    if kind in ("function", "custom"):
        named = choice.get(kind) or {}
        if not isinstance(named, dict):
            raise GrammarError(f"tool_choice.{kind} must be an object with a name", f"tool_choice.{kind}")
        name = named.get("name", choice.get("name"))
        if name not in by_name:
            raise GrammarError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return [by_name[name]], True
    if kind == "allowed_tools":
        body = choice.get("allowed_tools") or {}
        listed = body.get("tools") if isinstance(body, dict) else None
        if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
            raise GrammarError(
                "tool_choice.allowed_tools must be an object whose tools is an array of tools",
                "tool_choice.allowed_tools",
            )
        mode = body.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise GrammarError(
                f"tool_choice.allowed_tools.mode {mode!r} is not auto or required",
                "tool_choice.allowed_tools.mode",
            )
        names = []
        for t in listed:
            inner = t.get(t.get("type", "function"))
            names.append((inner if isinstance(inner, dict) else t).get("name"))
        missing = [n for n in names if n not in by_name]
        if missing or not names:
            raise GrammarError(
                f"tool_choice.allowed_tools names tools not in tools: {missing or 'none given'}",
                "tool_choice.allowed_tools",
            )
        if mode == "required":
            return [by_name[n] for n in names], True
        return None
    raise GrammarError(
        f"tool_choice.type {kind!r} is not function, custom or allowed_tools", "tool_choice.type"
    )


def build_matcher(
    ctx: GrammarContext,
    *,
    response_format: dict | None = None,
    tools: list[dict] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    dialect: Any = None,
    prompt_opens_thinking: bool = False,
) -> GrammarMatcher | None:
    """The request's matcher, or None when nothing constrains it (plain text, tool_choice auto/none).

    When the prompt left a thinking block open, free reasoning up to the dialect's end tag comes first.
    """
    g = ctx.builder()
    warnings: list[str] = []
    specs = tool_specs(tools)
    branches: list[str] = []
    param = "response_format"
    if response_format and response_format.get("type", "text") != "text":
        branches.append(_json_format(response_format, g))
    chosen = _named_tools(tool_choice, specs) if specs else None
    if chosen is None and branches and specs and dialect is not None and tool_choice != "none":
        _strict_tool_schemas(specs)
        # JSON answer + tools under auto: the first value or call opener picks the branch
        one = "(" + " | ".join(dialect.call_grammar(s, g) for s in specs) + ")"
        branches.append(dialect.calls_grammar(one, parallel_tool_calls, g))
    if chosen is not None:
        if dialect is None:
            raise GrammarError(
                "this model has no tool-call dialect, so tool_choice cannot be enforced", "tool_choice"
            )
        allowed, _ = chosen
        _strict_tool_schemas(allowed)
        one = "(" + " | ".join(dialect.call_grammar(s, g) for s in allowed) + ")"
        parallel = parallel_tool_calls and not (
            isinstance(tool_choice, dict) and tool_choice.get("type") in ("function", "custom")
        )
        branches = [dialect.calls_grammar(one, parallel, g)]  # a required call replaces any JSON answer
        param = "tool_choice"
    if not branches:
        return None
    body = branches[0] if len(branches) == 1 else "(" + " | ".join(branches) + ")"
    if prompt_opens_thinking:
        end = dialect.think_end if dialect is not None else "</think>"
        body = f"{g.text_until(end, 'reasoning')} /[\\n ]{{0,4}}/ {body}"
    return GrammarMatcher(ctx, g.grammar(body), warnings, param)
