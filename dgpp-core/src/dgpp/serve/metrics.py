"""``/metrics`` JSON and ``/metrics/prometheus`` (``dgpp_*`` names), built when scraped.

The key groups follow the original engine's ``/metrics`` (github.com/HawkBearPig/dgpp). Everything comes from
what the step loop publishes (``dgpp.sched.published``: counters, and gauges written once per pass) and the
HTTP side's own counters; nothing here reads the scheduler. ``snapshot_age_ms`` says how old the gauges are.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dgpp.engine.speculative_stats import SpecDecodeStats
from dgpp.sched.published import Published
from dgpp.sched.request import RetireReason

_NO_SPEC = SpecDecodeStats(0, "none").as_metrics()


def _avg(total: float, count: int) -> float:
    return total / count if count else 0.0


def engine_report(p: Published) -> dict[str, Any]:
    """The ``scheduler``, ``prefix_cache`` and ``prefill`` groups from what the step loop published."""
    st, pcs, shape, g = p.stats, p.prefix_stats, p.prefix_cache, p.gauges
    now = time.monotonic()
    rows = [
        {
            "id": r.request_id,
            "slot": r.slot,
            "prompt_tokens": r.prompt_tokens,
            "processed_tokens": r.processed_tokens,
            "cached_tokens": r.cached_tokens,
            "computed_tokens": r.processed_tokens - r.cached_tokens,
            "remaining_tokens": max(0, r.prompt_tokens - r.processed_tokens),
            "elapsed_ms": (now - (r.admitted_at or now)) * 1000.0,
        }
        for r in g.prefilling
    ]
    summed = {
        k: sum(r[k] for r in rows)
        for k in ("prompt_tokens", "processed_tokens", "cached_tokens", "computed_tokens", "remaining_tokens")
    }
    finished = dict(st.finished)
    return {
        "scheduler": {
            "active": g.active,
            "queued": g.queued,
            "terminal": sum(finished.values()),
            "records": g.active + g.queued,
            "record_tokens": g.record_tokens,
            "pool_blocks_total": p.pool_blocks_total,
            "pool_blocks_in_use": g.pool_blocks_in_use,
            "prefilling": len(rows),
            "tokens_generated": st.tokens_generated,
            "prompts_prefilled": st.prompts_prefilled,
            "prompt_tokens": st.prompt_tokens,
            "prompt_tokens_computed": st.prompt_tokens_computed,
            "decode_steps": st.decode_steps,
            "decode_rows": st.decode_rows,
            "decode_batch": {
                "last_slots": st.last_decode_rows,
                "last_active": g.decoding,
                "last_rows_per_request": st.last_rows_per_request,
                "rows": st.decode_batch_rows,
                **p.replays.as_metrics(),
            },
            "spec_decode": p.speculative.as_metrics() if p.speculative is not None else dict(_NO_SPEC),
            "prefill_ms": st.prefill_ms,
            "prefill_request_ms": st.prefill_request_ms,
            "step_ms": st.step_ms,
            "finished": finished,
            "reservations_grown": st.reservations_grown,
        },
        "prefix_cache": {
            "enabled": shape.enabled,
            "slots": shape.snapshot_slots,
            "min_tokens": shape.min_tokens,
            "head_cuts": 0,
            "entries": g.prefix_entries,
            "hits": pcs.hits,
            "misses": pcs.misses,
            "tokens_saved": pcs.tokens_saved,
            "snapshots": pcs.snapshots,
            "head_snapshots": 0,
            "close_entries": 0,
            "rolling_snapshots": 0,
            "hop_snapshots": 0,
            "evictions": pcs.evictions,
            "duplicates": pcs.duplicates,
            "skipped_no_block": 0,
            "skipped_no_slot": pcs.skipped_no_slot,
            "skipped_image_bytes": 0,
            "image_bytes": 0,
            "blocks_pinned": g.prefix_blocks_pinned,
            "snapshot_bytes": g.prefix_snapshots * shape.snapshot_bytes_each,
            "arena_snapshots": g.prefix_snapshots,
            "snapshot_ms_avg": _avg(pcs.snapshot_ms, pcs.snapshots),
            "arena_attaches": pcs.attaches,
            "attach_ms_avg": _avg(pcs.attach_ms, pcs.attaches),
            "ttft_hit_count": pcs.ttft_hit_count,
            "ttft_hit_ms_avg": _avg(pcs.ttft_hit_ms, pcs.ttft_hit_count),
            "ttft_miss_count": pcs.ttft_miss_count,
            "ttft_miss_ms_avg": _avg(pcs.ttft_miss_ms, pcs.ttft_miss_count),
            "key": f"cut={shape.cut}",
            "attach_tokens": shape.attach_tokens,
        },
        "prefill": {"requests": rows, **summed},
    }


def _version() -> str:
    from dgpp import __version__

    return str(__version__)


def metrics_json(backend: Any) -> dict[str, Any]:
    """The full ``/metrics`` body: what the step loop published plus the HTTP side's counters."""
    published, inbox = backend.published, backend.inbox
    snap = engine_report(published)
    sched_part = snap["scheduler"]
    finished = sched_part.pop("finished")
    grown = sched_part.pop("reservations_grown")
    sched_part["snapshot_age_ms"] = (time.monotonic() - published.at) * 1000.0
    pending_adm, pending_cancel = inbox.pending
    cfg = published.config
    c = backend.counters
    service = {
        "requests_total": c.requests_total,
        "requests_shed": inbox.requests_shed,
        "pending_admissions": pending_adm,
        "pending_cancellations": pending_cancel,
        "requests_cancelled": finished.get(RetireReason.CANCELLED.value, 0),
        "requests_shed_pool": finished.get(RetireReason.POOL_EXHAUSTED.value, 0),
        "requests_failed": c.requests_failed,
        "engine_failed": inbox.failed is not None,
        "reservations_grown": grown,
        "admission": {
            "mode": cfg.admission,
            "window": cfg.admission_window,
            "prefill_budget_tokens": cfg.chunk_tokens * cfg.busy_chunks,
            "prefill_idle_budget_tokens": cfg.chunk_tokens * cfg.idle_chunks,
        },
        "tokens_out": c.tokens_out,
        "rejects_bad": c.rejects_bad,
        "tool_calls_out": c.tool_calls_out,
    }
    return {
        "scheduler": sched_part,
        "service": service,
        "prefix_cache": snap["prefix_cache"],
        "prefill": snap["prefill"],
        "finished": finished,
    }


class _Collector:
    """Renders the JSON metrics as Prometheus families at scrape time (label ``model_name``)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        m = metrics_json(self.backend)
        label = self.backend.model_id
        sch, svc, pc, pre = m["scheduler"], m["service"], m["prefix_cache"], m["prefill"]
        cfg = self.backend.published.config

        def gauge(name: str, value: float, doc: str = "") -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"dgpp_{name}", doc or name, labels=["model_name"])
            g.add_metric([label], float(value))
            return g

        def counter(name: str, value: float, doc: str = "") -> CounterMetricFamily:
            c = CounterMetricFamily(f"dgpp_{name}", doc or name, labels=["model_name"])
            c.add_metric([label], float(value))
            return c

        total = sch.get("pool_blocks_total", 0) or 1
        info = GaugeMetricFamily(
            "dgpp_build_info",
            "build and deployment",
            labels=["model_name", "version", "git_sha", "world_size", "admission"],
        )
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
        by_slots = CounterMetricFamily(
            "dgpp_decode_batch_replays_by_slots",
            "decode graph replays by captured size",
            labels=["model_name", "slots"],
        )
        for slots, n in batch.get("replays_by_slots", {}).items():
            by_slots.add_metric([label, slots], float(n))
        yield by_slots
        spec = sch.get("spec_decode", {})
        yield gauge("spec_decode_depth", spec.get("depth", 0))
        yield gauge("spec_decode_schedule_lambda", spec.get("schedule_lambda", 0.0))
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):  # vLLM's spec_decode counters
            yield counter(f"spec_decode_{key}", spec.get(f"{key}_total", 0))
        yield from _spec_by_position(label, spec)
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
        finished = CounterMetricFamily(
            "dgpp_request_finished", "retired sequences by reason", labels=["model_name", "reason"]
        )
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
        for key in (
            "hits",
            "misses",
            "tokens_saved",
            "snapshots",
            "evictions",
            "duplicates",
            "skipped_no_slot",
        ):
            yield counter(f"prefix_cache_{key}", pc.get(key, 0))
        yield counter("prefix_cache_queries", pc.get("hits", 0) + pc.get("misses", 0))


class PrometheusExport:
    """The scheduler/service families (read at scrape time), then the backend's request histograms (observed
    as choices retire)."""

    def __init__(self, backend: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(backend))
        self.histograms = backend.histograms

    def text(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.histograms.registry)


def _spec_by_position(label: str, spec: dict[str, Any]) -> Any:
    """The per-position draft and acceptance counters (vLLM's ``spec_decode_num_accepted_tokens_per_pos``) and the
    verifies per verified depth, labelled with the drafter that proposed them (``mtp`` or ``lookup``)."""
    drafter = str(spec.get("drafter", "none"))
    families = (
        ("num_draft_tokens_per_pos", "draft tokens verified at each position", "position"),
        ("num_accepted_tokens_per_pos", "draft tokens accepted at each position", "position"),
        ("num_verifies_per_depth", "request verifies by the number of drafts verified", "depth"),
    )
    for key, doc, by in families:
        family = CounterMetricFamily(f"dgpp_spec_decode_{key}", doc, labels=["model_name", "drafter", by])
        for i, n in enumerate(spec.get(f"{key}_total", [])):
            family.add_metric([label, drafter, str(i)], float(n))
        yield family
