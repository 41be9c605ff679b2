"""OpenAI ``reasoning_effort`` -> chat-template kwargs, per family."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dgpp.text.errors import TemplateError

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Template variables that switch thinking on or off, in the order they are tried.
SWITCHES = ("enable_thinking", "thinking")


@dataclass(frozen=True)
class EffortMapping:
    """How one family's templates take a reasoning effort.

    ``levels`` maps each positive effort to the value given to the template variable ``key``; ``none``
    turns thinking off through a switch variable (``enable_thinking`` / ``thinking``). A template without
    ``key`` only gets the switch: positive efforts enable, ``none`` disables.
    """

    levels: Mapping[str, Any] = field(default_factory=dict)
    key: str = "reasoning_effort"

    def kwargs(
        self, effort: str | None, accepted: frozenset[str], explicit: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Template kwargs for ``effort`` given the variables the template reads and the caller's own kwargs
        (``explicit``: ``chat_template_kwargs``, which the caller applies over these)."""
        if effort is None:
            return {}
        if effort not in EFFORTS:
            raise TemplateError(
                f"reasoning_effort {effort!r} is not one of {', '.join(EFFORTS)}", "reasoning_effort"
            )
        thinking = effort != "none"
        switch = next((s for s in SWITCHES if s in accepted), None)
        if switch is not None and switch in explicit:
            # the request's own switch wins over the one the effort implies (the original engine's rule:
            # its API check sends reasoning_effort "low" with enable_thinking false and expects no thinking);
            # the effort's level variable is then set only when thinking stays on
            thinking = bool(explicit[switch])
        out: dict[str, Any] = {}
        if switch is not None:
            out[switch] = thinking
        elif not thinking:
            raise TemplateError(
                "reasoning_effort 'none' needs a chat template with a thinking switch (enable_thinking/thinking)",
                "reasoning_effort",
            )
        if thinking and self.key in accepted and effort in self.levels:
            out[self.key] = self.levels[effort]
        return out

    def describe(self, accepted: frozenset[str]) -> dict[str, dict[str, Any]]:
        """``/v1/models`` ``reasoning.effort_mapping``: effort -> the kwargs it becomes for this template."""
        table: dict[str, dict[str, Any]] = {}
        for effort in EFFORTS:
            try:
                table[effort] = self.kwargs(effort, accepted, {})
            except TemplateError:
                continue
        return table


# A template that only has a switch (or nothing): positive efforts enable thinking, none disables it.
SWITCH_ONLY = EffortMapping()
