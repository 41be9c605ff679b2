"""Per-request latency and size histograms for ``/metrics/prometheus`` (``dgpp_request_*``).

Observed on the event loop when a choice's retirement event is drained (``EventRelay``, whoever is still
reading the request), from the timing the step loop sends with each event (arrival, admission, first and last
token, token counts); nothing here runs on the step loop's thread.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram

from dgpp.sched.request import RetireReason, SeqTiming

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKENS = (1, 8, 32, 128, 512, 2048, 8192, 32768, 131072)


class RequestHistograms:
    """The ``dgpp_*`` request histograms, labelled ``model_name`` (TTFT also by ``prefix_cache`` hit/miss)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(
            auto_describe=False
        )  # ``PrometheusExport`` adds the scrape-time families
        registry = self.registry

        def hist(name: str, doc: str, buckets: tuple, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(f"dgpp_{name}", doc, ["model_name", *extra], buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "arrival to first token", _LATENCY, ("prefix_cache",))
        self.queue = hist("request_queue_time_seconds", "arrival to admission", _LATENCY)
        self.prefill = hist("request_prefill_time_seconds", "admission to first token", _LATENCY)
        self.decode = hist("request_decode_time_seconds", "first to last token", _LATENCY)
        self.e2e = hist("e2e_request_latency_seconds", "arrival to retirement", _LATENCY)
        self.tpot = hist("request_time_per_output_token_seconds", "mean gap between output tokens", _LATENCY)
        self.prompt = hist("request_prompt_tokens", "prompt tokens per sequence", _TOKENS)
        self.generation = hist("request_generation_tokens", "generated tokens per sequence", _TOKENS)

    def retired(self, t: SeqTiming, reason: RetireReason) -> None:
        """A choice retired just now (its last event reached the event loop)."""
        self.observe(t, reason, time.monotonic())

    def observe(self, t: SeqTiming, reason: RetireReason, now: float) -> None:
        m = self.model_name
        if reason is RetireReason.FAILED:
            return
        self.prompt.labels(m).observe(t.prompt_tokens)
        self.generation.labels(m).observe(t.output_tokens)
        self.e2e.labels(m).observe(now - t.arrival)
        if t.admitted_at is not None:
            self.queue.labels(m).observe(t.admitted_at - t.arrival)
        if t.first_token_at is None:
            return
        self.ttft.labels(m, "hit" if t.cached_tokens else "miss").observe(t.first_token_at - t.arrival)
        if t.admitted_at is not None:
            self.prefill.labels(m).observe(t.first_token_at - t.admitted_at)
        if t.last_token_at is not None:
            self.decode.labels(m).observe(t.last_token_at - t.first_token_at)
            if t.output_tokens > 1:
                self.tpot.labels(m).observe((t.last_token_at - t.first_token_at) / (t.output_tokens - 1))
