"""Counters the scheduler keeps for ``/metrics``, Prometheus and the periodic stats line."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dgpp.sched.request import RetireReason, Sequence


@dataclass
class SchedulerStats:
    """Monotonic counters (totals since start) plus the last decode batch's shape."""

    admitted_total: int = 0
    prompts_prefilled: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_computed: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    decode_only_steps: int = 0  # steps without prompt tokens: the ones decode rates are measured on
    decode_only_rows: int = 0
    prefill_ms: float = 0.0
    prefill_request_ms: float = 0.0  # summed per request, admission to prefill done (batch mates each count)
    decode_ms: float = 0.0
    step_ms: float = 0.0
    reservations_grown: int = 0
    last_decode_rows: int = 0
    decode_batch_rows: int = 0  # target rows the decode passes fed: 1 per request, 1 + drafts under MTP
    last_rows_per_request: float = 0.0
    finished: Counter = field(default_factory=Counter)

    def admitted(self, s: Sequence) -> None:
        self.admitted_total += 1
        self.prompt_tokens += s.prompt_len
        self.prompt_tokens_cached += s.cached_tokens

    def stepped(
        self, prefill_tokens: int, decode_rows: int, seconds: float, batch_rows: int | None = None
    ) -> None:
        """One model pass: ``decode_rows`` requests decoded over ``batch_rows`` target rows (default one each)."""
        self.prompt_tokens_computed += prefill_tokens
        if decode_rows:
            batch_rows = decode_rows if batch_rows is None else batch_rows
            self.decode_steps += 1
            self.decode_rows += decode_rows
            self.last_decode_rows = decode_rows
            self.decode_batch_rows += batch_rows
            self.last_rows_per_request = batch_rows / decode_rows
        # a mixed step is booked to prefill when it carries prompt tokens: that is what dominates its time
        if prefill_tokens:
            self.prefill_ms += seconds * 1000.0
        else:
            self.decode_ms += seconds * 1000.0
            self.decode_only_steps += 1
            self.decode_only_rows += decode_rows

    def prefill_done(self, admitted_at: float | None, now: float) -> None:
        if admitted_at is not None:
            self.prefill_request_ms += (now - admitted_at) * 1000.0

    def retired(self, reason: RetireReason) -> None:
        self.finished[reason.value] += 1
