"""``/metrics`` JSON (anchor §2.11 key groups) and ``/metrics/prometheus`` (``dgpp_*`` names, §2.12).

The scheduler part is captured on the step loop's thread after each pass (``scheduler_snapshot``) so a
reader never walks structures the scheduler is changing; ``snapshot_age_ms`` says how old it is.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dgpp.engine.graphs import ReplayStats
from dgpp.sched.request import RetireReason, SeqStatus
from dgpp.sched.scheduler import Scheduler
from dgpp.serve.histograms import RequestHistograms


def _avg(total: float, count: int) -> float:
    return total / count if count else 0.0


def _replay_stats(s: Scheduler) -> dict[str, Any]:
    """The decode graphs' replay counters (zeros when the runner has none: eager, MTP, a toy runner)."""
    graphs = getattr(s.runner, "graphs", None)
    if graphs is None:
        return ReplayStats().as_metrics()
    return graphs.stats.as_metrics()


def scheduler_snapshot(s: Scheduler) -> dict[str, Any]:
    st, pc = s.stats, s.prefix_cache
    now = time.monotonic()
    prefilling = [q for q in s.live if q.status is SeqStatus.PREFILL]
    rows = [
        {"id": q.request_id, "slot": q.slot, "prompt_tokens": q.prompt_len, "processed_tokens": q.computed,
         "cached_tokens": q.cached_tokens, "computed_tokens": q.computed - q.cached_tokens,
         "remaining_tokens": q.remaining_prefill, "elapsed_ms": (now - (q.admitted_at or now)) * 1000.0}
        for q in prefilling
    ]
    summed = {k: sum(r[k] for r in rows) for k in
              ("prompt_tokens", "processed_tokens", "cached_tokens", "computed_tokens", "remaining_tokens")}
    decode_live = sum(1 for q in s.live if q.status is SeqStatus.DECODE)
    return {
        "scheduler": {
            "active": len(s.live), "queued": len(s.waiting), "terminal": sum(st.finished.values()),
            "records": len(s.live) + len(s.waiting), "record_tokens": sum(q.prompt_len + len(q.output) for q in s.live),
            "pool_blocks_total": s.blocks.num_blocks, "pool_blocks_in_use": s.blocks.num_in_use,
            "prefilling": len(prefilling), "tokens_generated": st.tokens_generated,
            "prompts_prefilled": st.prompts_prefilled, "prompt_tokens": st.prompt_tokens,
            "prompt_tokens_computed": st.prompt_tokens_computed, "decode_steps": st.decode_steps,
            "decode_rows": st.decode_rows,
            "decode_batch": {
                "last_slots": st.last_decode_rows, "last_active": decode_live,
                "last_rows_per_request": st.last_rows_per_request, "rows": st.decode_batch_rows,
                **_replay_stats(s),
            },
            "spec_decode": s.speculative.stats.as_metrics() if s.speculative is not None else {
                "depth": 0, "drafter": "none", "num_drafts_total": 0, "num_draft_tokens_total": 0, "num_accepted_tokens_total": 0,
                "num_draft_tokens_per_pos_total": [], "num_accepted_tokens_per_pos_total": []},
            "prefill_ms": st.prefill_ms, "prefill_request_ms": st.prefill_request_ms, "step_ms": st.step_ms,
            "finished": dict(st.finished), "reservations_grown": st.reservations_grown,
        },
        "prefix_cache": {
            "enabled": pc.enabled, "slots": pc.slots.num_snapshots if pc.slots else 0, "min_tokens": pc.min_tokens,
            "head_cuts": 0, "entries": pc.num_entries, "hits": pc.stats.hits, "misses": pc.stats.misses,
            "tokens_saved": pc.stats.tokens_saved, "snapshots": pc.stats.snapshots, "head_snapshots": 0,
            "close_entries": 0, "rolling_snapshots": 0, "hop_snapshots": 0, "evictions": pc.stats.evictions,
            "duplicates": pc.stats.duplicates, "skipped_no_block": 0, "skipped_no_slot": pc.stats.skipped_no_slot,
            "skipped_image_bytes": 0, "image_bytes": 0, "blocks_pinned": pc.blocks_pinned,
            "snapshot_bytes": pc.num_snapshots * pc.snapshot_bytes_each, "arena_snapshots": pc.num_snapshots,
            "snapshot_ms_avg": _avg(pc.stats.snapshot_ms, pc.stats.snapshots), "arena_attaches": pc.stats.attaches,
            "attach_ms_avg": _avg(pc.stats.attach_ms, pc.stats.attaches),
            "ttft_hit_count": pc.stats.ttft_hit_count, "ttft_hit_ms_avg": _avg(pc.stats.ttft_hit_ms, pc.stats.ttft_hit_count),
            "ttft_miss_count": pc.stats.ttft_miss_count,
            "ttft_miss_ms_avg": _avg(pc.stats.ttft_miss_ms, pc.stats.ttft_miss_count), "key": f"cut={pc.cut}",
            "attach_tokens": pc.attach_every,
        },
        "prefill": {"requests": rows, **summed},
    }


def _version() -> str:
    from dgpp import __version__

    return str(__version__)


def metrics_json(backend: Any) -> dict[str, Any]:
    """The full ``/metrics`` body: the step loop's last snapshot plus the HTTP side's counters."""
    loop = backend.loop
    snap = dict(loop.published)
    sched_part = dict(snap.get("scheduler", {}))
    finished = sched_part.pop("finished", {})
    grown = sched_part.pop("reservations_grown", 0)
    sched_part["snapshot_age_ms"] = (time.monotonic() - loop.published_at) * 1000.0
    pending_adm, pending_cancel = loop.pending
    cfg = loop.scheduler.config
    c = backend.counters
    service = {
        "requests_total": c.requests_total, "requests_shed": loop.requests_shed,
        "pending_admissions": pending_adm, "pending_cancellations": pending_cancel,
        "requests_cancelled": finished.get(RetireReason.CANCELLED.value, 0),
        "requests_shed_pool": finished.get(RetireReason.POOL_EXHAUSTED.value, 0),
        "requests_failed": c.requests_failed, "engine_failed": loop.failed is not None,
        "reservations_grown": grown,
        "admission": {"mode": cfg.admission, "window": cfg.admission_window,
                      "prefill_budget_tokens": cfg.chunk_tokens * cfg.busy_chunks,
                      "prefill_idle_budget_tokens": cfg.chunk_tokens * cfg.idle_chunks},
        "tokens_out": c.tokens_out, "rejects_bad": c.rejects_bad, "tool_calls_out": c.tool_calls_out,
    }
    return {"scheduler": sched_part, "service": service, "prefix_cache": snap.get("prefix_cache", {}),
            "prefill": snap.get("prefill", {}), "finished": finished}


class _Collector:
    """Renders the JSON metrics as Prometheus families at scrape time (label ``model_name``)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        m = metrics_json(self.backend)
        label = self.backend.model_id
        sch, svc, pc, pre = m["scheduler"], m["service"], m["prefix_cache"], m["prefill"]
        cfg = self.backend.loop.scheduler.config

        def gauge(name: str, value: float, doc: str = "") -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"dgpp_{name}", doc or name, labels=["model_name"])
            g.add_metric([label], float(value))
            return g

        def counter(name: str, value: float, doc: str = "") -> CounterMetricFamily:
            c = CounterMetricFamily(f"dgpp_{name}", doc or name, labels=["model_name"])
            c.add_metric([label], float(value))
            return c

        total = sch.get("pool_blocks_total", 0) or 1
        info = GaugeMetricFamily("dgpp_build_info", "build and deployment", labels=["model_name", "version",
                                 "git_sha", "world_size", "admission"])
        info.add_metric([label, _version(), "", "1", cfg.admission], 1.0)
        yield info
        yield gauge("engine_failed", svc["engine_failed"])
        yield gauge("max_concurrent_requests", cfg.max_concurrency)
        yield gauge("queue_limit", cfg.queue_limit)
        yield gauge("kv_pool_tokens", self.backend.limits.kv_pool_tokens)
        yield gauge("admission_window_tokens", cfg.admission_window)
        yield gauge("admission_prefill_budget_tokens", svc["admission"]["prefill_budget_tokens"])
        yield gauge("admission_prefill_idle_budget_tokens", svc["admission"]["prefill_idle_budget_tokens"])
        yield gauge("num_requests_running", sch.get("active", 0))
        yield gauge("num_requests_waiting", sch.get("queued", 0))
        yield gauge("num_requests_prefilling", sch.get("prefilling", 0))
        yield gauge("pending_admissions", svc["pending_admissions"])
        yield gauge("pending_cancellations", svc["pending_cancellations"])
        yield gauge("kv_pool_blocks_total", sch.get("pool_blocks_total", 0))
        yield gauge("kv_pool_blocks_in_use", sch.get("pool_blocks_in_use", 0))
        yield gauge("kv_cache_usage_perc", sch.get("pool_blocks_in_use", 0) / total)
        yield gauge("scheduler_snapshot_age_seconds", sch["snapshot_age_ms"] / 1000.0)
        yield gauge("prefill_inflight_prompt_tokens", pre.get("prompt_tokens", 0))
        yield gauge("prefill_inflight_remaining_tokens", pre.get("remaining_tokens", 0))
        batch = sch.get("decode_batch", {})
        yield gauge("decode_batch_last_slots", batch.get("last_slots", 0))
        yield gauge("decode_batch_last_active", batch.get("last_active", 0))
        yield gauge("decode_batch_last_rows_per_request", batch.get("last_rows_per_request", 0))
        for key in ("replays", "rows", "padded_rows"):
            yield counter(f"decode_batch_{key}", batch.get(key, 0))
        by_slots = CounterMetricFamily("dgpp_decode_batch_replays_by_slots", "decode graph replays by captured size",
                                       labels=["model_name", "slots"])
        for slots, n in batch.get("replays_by_slots", {}).items():
            by_slots.add_metric([label, slots], float(n))
        yield by_slots
        spec = sch.get("spec_decode", {})
        yield gauge("spec_decode_depth", spec.get("depth", 0))
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):  # vLLM's spec_decode counters
            yield counter(f"spec_decode_{key}", spec.get(f"{key}_total", 0))
        yield gauge("prefix_cache_snapshot_bytes", pc.get("snapshot_bytes", 0))
        yield gauge("prefix_cache_entries", pc.get("entries", 0))
        yield gauge("prefix_cache_slots", pc.get("slots", 0))
        yield gauge("prefix_cache_blocks_pinned", pc.get("blocks_pinned", 0))
        yield counter("requests", svc["requests_total"])
        yield counter("shed", svc["requests_shed"])
        yield counter("shed_pool", svc["requests_shed_pool"])
        yield counter("cancelled", svc["requests_cancelled"])
        yield counter("failed", svc["requests_failed"])
        yield counter("rejected", svc["rejects_bad"])
        yield counter("reservations_grown", svc["reservations_grown"])
        yield counter("tool_calls", svc["tool_calls_out"])
        finished = CounterMetricFamily("dgpp_request_finished", "retired sequences by reason",
                                       labels=["model_name", "reason"])
        for reason in ("none", "eos", "length", "cancelled", "pool_exhausted", "stop"):
            finished.add_metric([label, reason], float(m["finished"].get(reason, 0)))
        yield finished
        yield counter("prompt_tokens", sch.get("prompt_tokens", 0))
        yield counter("prompt_tokens_computed", sch.get("prompt_tokens_computed", 0))
        yield counter("prompt_tokens_cached", pc.get("tokens_saved", 0))
        yield counter("generation_tokens", sch.get("tokens_generated", 0))
        yield counter("prompts_prefilled", sch.get("prompts_prefilled", 0))
        yield counter("prefill_seconds", sch.get("prefill_ms", 0.0) / 1000.0)
        yield counter("prefill_request_seconds", sch.get("prefill_request_ms", 0.0) / 1000.0)
        yield counter("decode_steps", sch.get("decode_steps", 0))
        yield counter("decode_rows", sch.get("decode_rows", 0))
        for key in ("hits", "misses", "tokens_saved", "snapshots", "evictions", "duplicates", "skipped_no_slot"):
            yield counter(f"prefix_cache_{key}", pc.get(key, 0))
        yield counter("prefix_cache_queries", pc.get("hits", 0) + pc.get("misses", 0))


class PrometheusExport:
    """One registry per backend: the scheduler/service families (read at scrape time) plus the request
    histograms (observed at retirement)."""

    def __init__(self, backend: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(backend))
        self.histograms = RequestHistograms(self.registry, backend.model_id)
        backend.loop.scheduler.on_retire.append(lambda s: self.histograms.observe(s, time.monotonic()))

    def text(self) -> bytes:
        return generate_latest(self.registry)
