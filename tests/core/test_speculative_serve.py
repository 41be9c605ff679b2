"""``engine.mtp`` through the real serving build (checkpoint → drafter hook → scheduler → HTTP): greedy chat
completions equal those of the same deployment with MTP off, and ``/metrics`` reports the drafts."""

from __future__ import annotations

import re

import openai
import pytest
from litestar.testing import TestClient

from dgpp.config import parse_config
from dgpp.serve.app import build_app
from dgpp.server_assembly import build_backend
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp_glm.testing_glm4 import build_tiny_glm4_moe

ENGINE = {
    "max_concurrency": 4,
    "kv_capacity": 2048,
    "block_size": 4,
    "prefill_budget_tokens": 8,
    "prefix_min_tokens": 0,
    "stats_interval_s": 0,
}
QUESTIONS = ["What is the weather in Paris today?", "Write a haiku about the sea.", "2 + 2 = ?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_tiny_glm4_moe(tmp_path_factory.mktemp("spec_serve"), seed=41)
    build_tiny_tokenizer(path)
    return path


def _answers(checkpoint, engine: dict) -> tuple[list[str], dict]:
    cfg = parse_config({"model": str(checkpoint), "engine": {**ENGINE, **engine}})
    served = build_backend(cfg, device="cpu")
    try:
        with TestClient(
            app=build_app(served, max_body_bytes=20000, sse_ping_interval=30), base_url="http://dgpp.local"
        ) as client:
            sdk = openai.OpenAI(base_url="http://dgpp.local/v1", api_key="x", http_client=client)
            out = [
                sdk.chat.completions.create(
                    model=str(checkpoint),
                    messages=[{"role": "user", "content": q}],
                    max_tokens=10,
                    temperature=0,
                    extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
                )
                .choices[0]
                .message.content
                for q in QUESTIONS
            ]
            metrics = client.get("/metrics").json()["scheduler"]["spec_decode"]
            prometheus = client.get("/metrics/prometheus").text
    finally:
        served.shutdown()
    metrics["prometheus_has_counters"] = "dgpp_spec_decode_num_drafts_total" in prometheus
    metrics["prometheus"] = prometheus
    return out, metrics


def _per_position(prometheus: str, name: str, drafter: str) -> list[float]:
    """The values of a per-position (or per-depth) family for ``drafter``, in label order."""
    found = re.findall(
        rf'^dgpp_spec_decode_{name}_total\{{[^}}]*drafter="{drafter}"[^}}]*\}} (\S+)$', prometheus, re.M
    )
    return [float(v) for v in found]


def test_served_greedy_with_mtp_equals_mtp_off(checkpoint):
    plain, off = _answers(checkpoint, {"mtp": False})
    spec, on = _answers(checkpoint, {"mtp": True, "mtp_depth": 2})
    assert spec == plain and all(plain)
    assert off["num_drafts_total"] == 0 and off["depth"] == 0
    assert on["depth"] == 2 and on["num_drafts_total"] > 0 and on["prometheus_has_counters"]
    assert on["num_draft_tokens_total"] == sum(on["num_draft_tokens_per_pos_total"])
    prom = on["prometheus"]
    assert _per_position(prom, "num_draft_tokens_per_pos", "mtp") == on["num_draft_tokens_per_pos_total"]
    assert (
        _per_position(prom, "num_accepted_tokens_per_pos", "mtp") == on["num_accepted_tokens_per_pos_total"]
    )
    assert _per_position(prom, "num_verifies_per_depth", "mtp") == on["num_verifies_per_depth_total"]


def test_served_greedy_with_scheduled_or_lookup_drafts_equals_plain(checkpoint):
    """``engine.mtp_schedule`` over MTP and prompt-lookup drafts through the server: the same answers, and the
    per-position counters carry the drafter that proposed them."""
    plain, _ = _answers(checkpoint, {"mtp": False})
    scheduled, on = _answers(checkpoint, {"mtp": True, "mtp_depth": 3, "mtp_schedule": True})
    assert scheduled == plain and on["scheduled"] and on["schedule_lambda"] > 0
    assert sum(on["num_verifies_per_depth_total"]) > 0
    looked, lookup = _answers(checkpoint, {"draft": "lookup", "draft_depth": 2})
    assert looked == plain and lookup["drafter"] == "lookup" and not lookup["scheduled"]
    prom = lookup["prometheus"]
    assert (
        _per_position(prom, "num_draft_tokens_per_pos", "lookup") == lookup["num_draft_tokens_per_pos_total"]
    )
    assert len(_per_position(prom, "num_verifies_per_depth", "lookup")) == 3
    assert not _per_position(prom, "num_verifies_per_depth", "mtp")
