"""A strict tool's string argument schema -> the regex its bare-text value must fully match.

The families' call syntaxes write string arguments as raw text between markers, not as JSON strings, so
``%json`` cannot enforce ``pattern`` / ``minLength`` / ``maxLength`` there. This turns those keywords into
one lexeme regex (llguidance's dialect: whole-lexeme match, no lookarounds, no intersection). JSON Schema's
``pattern`` is a search: it is padded with any text unless anchored at that end. What cannot be expressed
exactly raises ``GrammarError``: a strict tool promises its arguments match the schema.
"""

from __future__ import annotations

from typing import Any

from dgpp.text.errors import GrammarError

ANY_TEXT = r"(?s:.*)"


def _top_level_alternation(pattern: str) -> bool:
    """Whether ``pattern`` has an unescaped ``|`` outside groups and character classes."""
    depth, in_class, escaped = 0, False, False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            return True
    return False


def _anchored_end(pattern: str) -> bool:
    """Whether ``pattern`` ends with an unescaped ``$``."""
    backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
    return pattern.endswith("$") and backslashes % 2 == 0


def _pattern_regex(pattern: str, where: str) -> str:
    start, end = pattern.startswith("^"), _anchored_end(pattern)
    inner = pattern[1 if start else 0 : len(pattern) - 1 if end else len(pattern)]
    if (start or end) and _top_level_alternation(inner):
        raise GrammarError(f"{where}: an anchored pattern with a top-level | cannot be enforced", "tools")
    return f"{'' if start else ANY_TEXT}(?:{inner}){'' if end else ANY_TEXT}"


def string_value_regex(prop: dict[str, Any], where: str) -> str | None:
    """The regex for a strict string argument, or None when its schema constrains nothing text can show."""
    pattern = prop.get("pattern")
    low, high = prop.get("minLength"), prop.get("maxLength")
    if pattern is not None and (low is not None or high is not None):
        raise GrammarError(f"{where}: pattern together with minLength/maxLength cannot be enforced", "tools")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise GrammarError(f"{where}: pattern must be a string", "tools")
        return _pattern_regex(pattern, where)
    if low is None and high is None:
        return None
    for name, value in (("minLength", low), ("maxLength", high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise GrammarError(f"{where}: {name} must be a non-negative integer", "tools")
    return f"(?s:.{{{low or 0},{'' if high is None else high}}})"
