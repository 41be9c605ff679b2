"""Speculative-decoding counters for ``/metrics`` (``spec_decode``, vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Totals since start. A *draft* is one request's proposal in one verify step (``num_drafts_total``);
    position ``i`` counts the ``i``-th draft token, accepted only when every earlier one was. ``verifies_per_depth[k]``
    counts the request-steps that verified ``k`` drafts (``k = 0``: a plain row: no match, a backoff, or a
    schedule that found no draft worth its row)."""

    depth: int
    drafter: str = "mtp"  # which drafter proposes: "mtp" or "lookup"
    num_drafts_total: int = 0
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    draft_tokens_per_pos: list[int] = field(default_factory=list)
    accepted_tokens_per_pos: list[int] = field(default_factory=list)
    verifies_per_depth: list[int] = field(default_factory=list)
    scheduled: bool = False  # engine.mtp_schedule decides each request's depth
    schedule_lambda: float = 0.0  # the schedule's value of decode time at the last pass, tokens/ms

    def __post_init__(self) -> None:
        self.draft_tokens_per_pos = [0] * self.depth
        self.accepted_tokens_per_pos = [0] * self.depth
        self.verifies_per_depth = [0] * (self.depth + 1)

    def verified(self, drafted: int, accepted: int) -> None:
        """One request's verify: ``drafted`` tokens proposed, the leading ``accepted`` of them kept."""
        self.verifies_per_depth[drafted] += 1
        if drafted == 0:
            return
        self.num_drafts_total += 1
        self.num_draft_tokens_total += drafted
        self.num_accepted_tokens_total += accepted
        for i in range(drafted):
            self.draft_tokens_per_pos[i] += 1
        for i in range(accepted):
            self.accepted_tokens_per_pos[i] += 1

    def as_metrics(self) -> dict:
        return {
            "depth": self.depth,
            "drafter": self.drafter,
            "num_drafts_total": self.num_drafts_total,
            "num_draft_tokens_total": self.num_draft_tokens_total,
            "num_accepted_tokens_total": self.num_accepted_tokens_total,
            "num_draft_tokens_per_pos_total": list(self.draft_tokens_per_pos),
            "num_accepted_tokens_per_pos_total": list(self.accepted_tokens_per_pos),
            "num_verifies_per_depth_total": list(self.verifies_per_depth),
            "scheduled": self.scheduled,
            "schedule_lambda": self.schedule_lambda,
        }
