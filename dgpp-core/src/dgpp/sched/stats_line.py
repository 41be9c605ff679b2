"""The periodic ``stats:`` log line, written every ``engine.stats_interval_s`` while busy."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from dgpp.sched.scheduler import Scheduler

log = structlog.get_logger("dgpp.engine")


class StatsLine:
    """Turns the scheduler's counters into rates over the last interval and logs one line."""

    def __init__(self, scheduler: Scheduler, interval_s: float) -> None:
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
