"""Confidence-scheduled verify depth (``engine.mtp_schedule``): each pass verifies, per request, only the leading
drafts whose predicted survival pays for their verify rows, as the original engine's schedule decides
(github.com/HawkBearPig/dgpp, src/engine/verify_schedule.hpp).

A request's ``i``-th draft survives only if every draft before it did; with ``p_j`` the predicted chance that
draft ``j`` is accepted given its prefix stood, ``S_i = p_1 ... p_i`` is the chance the first ``i`` all stand,
non-increasing in ``i``. A pass over ``k`` drafts commits ``1 + S_1 + ... + S_k`` tokens in expectation and costs
``base_ms + row_ms * rows`` (``rows``: the verify rows of the whole batch). Throughput over a run is a ratio of
sums, whose optimum is a per-pass linear trade at one multiplier ``lambda`` (tokens/ms, the achieved
throughput): each extra row must bring ``S_i > lambda * row_ms``. The base cost only sets ``lambda``.

- ``p_j``: an MTP draft's own softmax probability under the drafter (the drafter's confidence); a lookup draft's
  request-level acceptance rate (``DraftTrack.rate``, a running mean of its drafts' outcomes). A sampled request
  keeps a draft with the target's probability of it, not when it is the argmax, so its ``p_j`` is scaled by
  ``engine.mtp_schedule_sampled_scale`` (0: sampled requests verify every draft, unscheduled).
- ``lambda``: ``engine.mtp_schedule_lambda``, or when 0 the reservation rate of a plain pass over the batch, ``B /
  (base_ms + B * row_ms)`` for ``B`` requests (a row is taken only when it beats decoding plainly). With
  ``engine.mtp_schedule_adapt`` it follows the modelled throughput of recent passes (committed tokens over
  ``base_ms + rows * row_ms``, never the wall clock), floored at that value. Both grow with the batch, so a
  larger batch verifies only the more confident drafts.
- ``engine.mtp_schedule_min_depth``: the fewest drafts a drafting request verifies. A request whose first draft
  keeps failing decodes plainly for 1, 3, 7, 15 passes (``DraftTrack``), then tries again.

Verification is exact at any depth, so the schedule changes the pace, never a greedy transcript or a sampled
request's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dgpp.sample.params import SamplingParams

#: weight of the newest pass in the adapted lambda and of the newest draft in a lookup request's rate
ADAPT_ALPHA = 1.0 / 16
RATE_ALPHA = 1.0 / 8


@dataclass(frozen=True)
class ScheduleSettings:
    """The ``engine.mtp_schedule_*`` keys."""

    row_ms: float = 8.0
    base_ms: float = 28.0
    lam: float = 0.0
    min_depth: int = 1
    adapt: bool = True
    sampled_scale: float = 0.93

    @classmethod
    def from_engine(cls, engine: Any) -> ScheduleSettings:
        return cls(
            row_ms=engine.mtp_schedule_row_ms,
            base_ms=engine.mtp_schedule_base_ms,
            lam=engine.mtp_schedule_lambda,
            min_depth=engine.mtp_schedule_min_depth,
            adapt=engine.mtp_schedule_adapt,
            sampled_scale=engine.mtp_schedule_sampled_scale,
        )


class DraftTrack:
    """One request's draft outcomes: the running acceptance rate of its drafts (each draft reached, its prefix
    having stood, is one trial) and the plain-decode backoff after passes whose first draft was wrong."""

    MAX_SKIP = 15

    def __init__(self) -> None:
        self.rate = 0.5  # no outcome yet: even odds
        self.misses = 0  # consecutive passes whose first draft was wrong
        self.skip = 0  # passes left without drafts

    def judged(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1)):
            self.rate += RATE_ALPHA * (float(i < accepted) - self.rate)
        if accepted:
            self.misses = 0
        elif drafted:
            self.misses += 1
            self.skip = min(2**self.misses - 1, self.MAX_SKIP)

    def resting(self) -> bool:
        """Whether this pass decodes plainly (a backoff pass, which it uses up)."""
        if self.skip:
            self.skip -= 1
            return True
        return False


@dataclass(frozen=True)
class PassRule:
    """One pass's decision for its requests: draft ``n`` (1-based) is verified while ``keeps`` says so."""

    threshold: float
    min_depth: int
    scales: list[float | None]  # per request: the factor on its confidences (None: verify every draft)

    def keeps(self, i: int, n: int, survival: float) -> bool:
        """Request ``i``'s ``n``-th draft, whose prefix survival (its own included) is ``survival``, is verified."""
        return self.scales[i] is None or n <= self.min_depth or survival > self.threshold

    def survival(self, i: int, before: float, confidence: float) -> float:
        """Request ``i``'s prefix survival one draft further, that draft's confidence being ``confidence``."""
        scale = self.scales[i]
        return before * confidence * (1.0 if scale is None else scale)

    def cut(self, i: int, confidences: list[float]) -> int:
        """How many of request ``i``'s drafts, of these per-draft confidences, to verify."""
        survival = 1.0
        for n, confidence in enumerate(confidences, 1):
            survival = self.survival(i, survival, confidence)
            if not self.keeps(i, n, survival):
                return n - 1
        return len(confidences)


class VerifySchedule:
    """The scheduled depth's state across passes: the adapted value of decode time."""

    def __init__(self, settings: ScheduleSettings) -> None:
        self.settings = settings
        self.lam: float | None = None  # adapted tokens/ms (None until the first pass)

    def floor(self, batch: int) -> float:
        """The configured value of decode time, or the reservation rate of a plain pass over ``batch`` requests."""
        s = self.settings
        if s.lam > 0:
            return s.lam
        return batch / (s.base_ms + batch * s.row_ms)

    def value(self, batch: int) -> float:
        floor = self.floor(batch)
        return max(floor, self.lam) if self.settings.adapt and self.lam is not None else floor

    def rule(self, params: list[SamplingParams]) -> PassRule:
        """The rule for a pass over requests with these sampling params."""
        s = self.settings
        sampled = s.sampled_scale if s.sampled_scale > 0 else None
        scales = [1.0 if p.greedy else sampled for p in params]
        return PassRule(self.value(len(params)) * s.row_ms, s.min_depth, scales)

    def observe(self, committed: int, rows: int) -> None:
        """A pass committed ``committed`` tokens over ``rows`` verify rows: its modelled throughput."""
        s = self.settings
        sample = committed / (s.base_ms + rows * s.row_ms)  # row_ms > 0 (the schema's bound)
        self.lam = sample if self.lam is None else self.lam + ADAPT_ALPHA * (sample - self.lam)
