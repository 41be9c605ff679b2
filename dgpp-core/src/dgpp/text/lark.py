"""Writing llguidance Lark grammars: literals that respect special tokens, lazy text, embedded JSON schemas.

Special tokens (e.g. DeepSeek's ``</think>``) never match literal text in llguidance, so a literal that
contains one is written as text pieces around a token reference ``<[id]>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

# Structural JSON whitespace: at most 16 consecutive bytes, so output cannot run away in blanks.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": True,
    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}",
}


def quote(text: str) -> str:
    """A Lark string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _slashes_escaped(regex: str) -> str:
    """``regex`` safe inside a Lark ``/.../`` literal: every ``/`` (escaped or not) becomes ``\\x2f``."""
    out, i = [], 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            out.append(r"\x2f" if regex[i + 1] == "/" else regex[i : i + 2])
            i += 2
            continue
        out.append(r"\x2f" if regex[i] == "/" else regex[i])
        i += 1
    return "".join(out)


class LarkBuilder:
    """Accumulates named rules; ``specials`` maps special-token text to its id."""

    def __init__(self, specials: Mapping[str, int]) -> None:
        self.specials = dict(specials)
        self._split = (
            re.compile(
                "(" + "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)) + ")"
            )
            if self.specials
            else None
        )
        self.rules: list[str] = []
        self.subgrammars: dict[str, str] = {}  # name -> a caller's own Lark grammar (custom tools)
        self._names: set[str] = set()

    def fresh(self, stem: str) -> str:
        base = re.sub(r"[^a-z0-9_]", "_", stem.lower()) or "r"
        name, k = base, 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def rule(self, stem: str, body: str, attrs: str = "") -> str:
        name = self.fresh(stem)
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def lit(self, text: str) -> str:
        """An expression matching exactly ``text`` (special tokens inside become token references)."""
        if not text:
            return '""'
        if self._split is None:
            return quote(text)
        parts = [p for p in self._split.split(text) if p]
        return " ".join(f"<[{self.specials[p]}]>" if p in self.specials else quote(p) for p in parts)

    def text_until(self, end: str, stem: str = "text", regex: str = r"(?s:.*)") -> str:
        """Text matching ``regex`` (by default any text) up to the first occurrence of ``end`` (included)."""
        literal = "/" + _slashes_escaped(regex) + "/"
        if end in self.specials:
            body = self.rule(stem, literal)
            return f"{body} <[{self.specials[end]}]>"
        if self._split is not None and self._split.search(end):
            raise ValueError(f"end marker {end!r} mixes text and special tokens")
        return self.rule(stem, literal, attrs=f"[suffix={quote(end)}]")

    def json(self, schema: Mapping[str, Any], lenient: bool = False) -> str:
        """An embedded JSON-schema value (``%json``), with dgpp's whitespace limits; ``lenient`` ignores
        keywords llguidance does not implement (non-strict tool schemas) instead of failing."""
        body = dict(schema)
        options = {**JSON_OPTIONS, **({"lenient": True} if lenient else {})}
        body["x-guidance"] = {**options, **(body.get("x-guidance") or {})}
        return "%json " + json.dumps(body, ensure_ascii=False)

    def subgrammar(self, stem: str, lark: str) -> str:
        """Reference a separate Lark grammar (its own ``start``); its rule names cannot clash with ours."""
        name = self.fresh(stem)
        self.subgrammars[name] = lark
        return f"@{name}"

    def grammar(self, start: str) -> str:
        """The finished grammar in the form ``llguidance.LLMatcher`` takes."""
        main = "\n".join([f"start: {start}", *self.rules]) + "\n"
        if not self.subgrammars:
            return main
        grammars = [{"lark_grammar": main}] + [
            {"name": n, "lark_grammar": g} for n, g in self.subgrammars.items()
        ]
        return json.dumps({"grammars": grammars}, ensure_ascii=False)
