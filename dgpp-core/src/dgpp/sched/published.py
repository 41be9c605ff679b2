"""What the step loop's thread publishes for readers on other threads (``/metrics``, Prometheus), and the periodic
``stats:`` log line it writes every ``engine.stats_interval_s`` while busy (``StatsLine``).

Two kinds of value, neither of which asks a reader to walk a structure the scheduler is changing:

* counters: the stats objects the scheduler (``SchedulerStats``), the prefix cache, the decode graphs and the
  speculative decoder add to (ints and floats, plus dicts a reader copies in one call); a reader sees each total
  as of some moment;
* gauges: ``EngineGauges``, a small immutable record the step thread writes once per pass (a reader gets one
  whole pass's values, never half of two).

The HTTP side builds its reports from a ``Published`` and the step loop's own hand-off counts, never from the
``Scheduler``.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from dgpp.sched.request import SeqStatus

if TYPE_CHECKING:
    from dgpp.sched.block_pool import BlockPool
    from dgpp.sched.config import SchedulerConfig
    from dgpp.sched.prefix_cache import PrefixCache, PrefixCacheStats
    from dgpp.sched.request import RetireReason, Sequence

log = structlog.get_logger("dgpp.engine")


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


class SchedulerView(Protocol):
    """What is published of a ``dgpp.sched.scheduler.Scheduler`` (which keeps its ``SchedulerStats`` here)."""

    config: SchedulerConfig
    blocks: BlockPool
    prefix_cache: PrefixCache
    stats: SchedulerStats
    runner: Any
    speculative: Any
    live: list[Sequence]
    waiting: deque[Sequence]


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """One request in prefill: how far its prompt has got."""

    request_id: str
    slot: int | None
    prompt_tokens: int
    processed_tokens: int
    cached_tokens: int
    admitted_at: float | None


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """The scheduler's state after one pass."""

    active: int = 0
    queued: int = 0  # choices waiting for admission
    decoding: int = 0
    record_tokens: int = 0  # prompt + output tokens of the live requests
    pool_blocks_in_use: int = 0
    prefix_entries: int = 0
    prefix_blocks_pinned: int = 0
    prefix_snapshots: int = 0
    prefilling: tuple[PrefillRow, ...] = ()


@dataclass(frozen=True)
class PrefixCacheShape:
    """What the prefix cache is (fixed for the engine's life)."""

    enabled: bool
    snapshot_slots: int
    min_tokens: int
    cut: int
    attach_tokens: int
    snapshot_bytes_each: int


class Published:
    """Counters and per-pass gauges of one scheduler. Built on the serving side's thread before the step loop
    starts; afterwards only ``publish`` (on the step loop's thread) writes it."""

    def __init__(self, scheduler: SchedulerView) -> None:
        from dgpp.engine.graphs import ReplayStats

        pc = scheduler.prefix_cache
        self.config: SchedulerConfig = scheduler.config
        self.pool_blocks_total = scheduler.blocks.num_blocks
        self.prefix_cache = PrefixCacheShape(
            pc.enabled,
            pc.slots.num_snapshots if pc.slots else 0,
            pc.min_tokens,
            pc.cut,
            pc.attach_every,
            pc.snapshot_bytes_each,
        )
        self.stats: SchedulerStats = scheduler.stats
        self.prefix_stats: PrefixCacheStats = pc.stats
        graphs = getattr(scheduler.runner, "graphs", None)  # eager, MTP or a toy runner: no replays to count
        self.replays = graphs.stats if graphs is not None else ReplayStats()
        self.speculative: Any = scheduler.speculative.stats if scheduler.speculative is not None else None
        self.gauges = EngineGauges()
        self.at = time.monotonic()

    def publish(self, scheduler: SchedulerView) -> None:
        """The gauges after a pass: one walk over the live requests (at most ``engine.max_concurrency``)."""
        prefilling = []
        record_tokens = 0
        for q in scheduler.live:
            record_tokens += len(q.prompt) + len(q.output)
            if q.status is SeqStatus.PREFILL:
                prefilling.append(
                    PrefillRow(q.request_id, q.slot, q.prompt_len, q.computed, q.cached_tokens, q.admitted_at)
                )
        pc = scheduler.prefix_cache
        self.gauges = EngineGauges(
            active=len(scheduler.live),
            queued=len(scheduler.waiting),
            decoding=len(scheduler.live) - len(prefilling),
            record_tokens=record_tokens,
            pool_blocks_in_use=scheduler.blocks.num_in_use,
            prefix_entries=pc.num_entries,
            prefix_blocks_pinned=pc.blocks_pinned,
            prefix_snapshots=pc.num_snapshots,
            prefilling=tuple(prefilling),
        )
        self.at = time.monotonic()


class StatsLine:
    """Turns the scheduler's counters into rates over the last interval and logs one line."""

    def __init__(self, scheduler: SchedulerView, interval_s: float) -> None:
        self.scheduler = scheduler
        self.interval_s = interval_s
        self._last_at = time.monotonic()
        self._last = self._counters()
        self._busy = False

    def _counters(self) -> dict[str, float]:
        st = self.scheduler.stats
        pc = self.scheduler.prefix_cache.stats
        return {
            "decode_rows": st.decode_only_rows,
            "decode_steps": st.decode_only_steps,
            "decode_ms": st.decode_ms,
            "prefill_tokens": st.prompt_tokens_computed,
            "prefill_ms": st.prefill_ms,
            "cached": st.prompt_tokens_cached,
            "hits": pc.hits,
            "queries": pc.hits + pc.misses,
            "admitted": st.admitted_total,
            "cancelled": st.finished.get("cancelled", 0),
            "shed": st.finished.get("pool_exhausted", 0),
        }

    def maybe_log(self, idle: bool) -> str | None:
        """Log when the interval has passed and something happened in it; returns the line (for tests)."""
        if self.interval_s <= 0:
            return None
        self._busy = self._busy or not idle
        now = time.monotonic()
        if now - self._last_at < self.interval_s:
            return None
        wall = now - self._last_at
        cur = self._counters()
        d = {k: cur[k] - self._last[k] for k in cur}
        self._last, self._last_at = cur, now
        if not self._busy:
            return None
        self._busy = False
        line = self.format(d, wall)
        log.info(line)
        return line

    def format(self, d: dict[str, float], wall: float) -> str:
        s = self.scheduler
        tok, steps = d["decode_rows"], d["decode_steps"]
        dec_s = d["decode_ms"] / 1000.0
        decode = (
            f"decode {tok / dec_s if dec_s else 0.0:.1f} tok/s, {d['decode_ms'] / tok if tok else 0.0:.2f} ms/tok, "
            f"{d['decode_ms'] / steps if steps else 0.0:.2f} ms/step ({int(steps)} steps / {int(tok)} tok, "
            f"{100.0 * dec_s / wall if wall else 0.0:.0f} % of wall)"
        )
        pre_s = d["prefill_ms"] / 1000.0
        ptok = d["prefill_tokens"]
        prefill = (
            f"prefill {ptok / pre_s if pre_s else 0.0:.1f} tok/s, {d['prefill_ms'] / ptok if ptok else 0.0:.2f} ms/tok, "
            f"cached {int(d['cached'])} ({int(d['hits'])}/{int(d['queries'])} hits)"
        )
        return (
            f"stats: {decode} | {prefill} | live {len(s.live)}, queued {len(s.waiting)} | "
            f"pool {s.blocks.num_in_use}/{s.blocks.num_blocks} blocks | "
            f"prefix cache {s.prefix_cache.num_entries}/{s.prefix_cache.num_snapshots} entries | "
            f"requests +{int(d['admitted'])} (shed {int(d['shed'])}, cancelled {int(d['cancelled'])})"
        )
