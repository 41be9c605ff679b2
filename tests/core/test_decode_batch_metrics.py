"""``/metrics`` ``decode_batch`` and ``prefill_request_ms`` count what happened: decode-graph replays and their
padding rows (the CPU graph-logic path), rows per request (1 in plain decode), per-request prefill time; the
same numbers reach Prometheus as ``dgpp_decode_batch_*`` / ``dgpp_prefill_request_seconds_total``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from dgpp.bench.models import build_random_model
from dgpp.engine.graphs import DecodeGraphs, ReplayStats
from dgpp.engine.runner import ModelRunner
from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.published import Published
from dgpp.sched.request import Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.sched.step_loop import StepLoop
from dgpp.serve.metrics import _Collector, engine_report
from dgpp.step.pools import CachePools
from dgpp.testing.scheduler import scheduler_config

BS, BLOCKS, MAX_TOKENS = 4, 48, 6


@pytest.fixture(scope="module")
def tiny_model():
    return build_random_model("tiny", "cpu", torch.float32, seed=7)


def _scheduler(model, graphs: bool) -> Scheduler:
    conf = scheduler_config(block_size=BS, chunk_tokens=16, max_concurrency=3, busy_chunks=3, idle_chunks=3)
    pools = CachePools(model.cache_spec(), BLOCKS, BS, conf.max_concurrency + 2)
    runner = ModelRunner(model, pools)
    if graphs:  # what decode_graph builds on CUDA; capture=False runs the same padded batch eagerly
        runner.graphs = DecodeGraphs(model, pools, max_batch=8, max_blocks=BLOCKS, capture=False)
    blocks, slots = BlockPool(BLOCKS, BS), SlotPool(conf.max_concurrency, 2)
    cache = PrefixCache(blocks, 16, hybrid=model.info.hybrid, slots=slots, copy_state=pools.copy_state)
    return Scheduler(conf, runner, blocks, slots, cache)


def _serve(sched: Scheduler, vocab: int) -> None:
    """Three 5-token prompts prefilled in one step, then decoded together for MAX_TOKENS - 1 steps."""
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        prompt = torch.randint(3, vocab, (5,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        sched.submit(
            [Sequence(f"r{i}", 0, prompt, params, ChoiceSampler(params, vocab, prompt), lambda s, ev: None)]
        )
    for _ in range(50):
        if not sched.has_work:
            break
        sched.tick()
    assert not sched.has_work


def test_graph_replays_padding_and_prefill_request_time(tiny_model) -> None:
    sched = _scheduler(tiny_model, graphs=True)
    _serve(sched, tiny_model.info.vocab_size)
    m = engine_report(Published(sched))["scheduler"]
    batch = m["decode_batch"]
    steps = MAX_TOKENS - 1  # the first token comes from the prefill step
    assert sched.stats.decode_only_steps == steps
    # 3 rows run in the size-4 graph: one padding row per replay
    assert batch["replays"] == steps and batch["padded_rows"] == steps
    assert batch["replays_by_slots"]["4"] == steps and sum(batch["replays_by_slots"].values()) == steps
    assert list(batch["replays_by_slots"]) == [str(i) for i in range(1, 17)]
    assert batch["rows"] == 3 * steps and batch["last_rows_per_request"] == 1.0 and batch["last_slots"] == 3
    # all three prompts were prefilled in one step, each waiting out the whole of it
    assert sched.stats.prompts_prefilled == 3 and m["prefill_ms"] > 0
    assert m["prefill_request_ms"] >= 3 * m["prefill_ms"]


def test_eager_decode_counts_no_replays(tiny_model) -> None:
    sched = _scheduler(tiny_model, graphs=False)
    _serve(sched, tiny_model.info.vocab_size)
    batch = engine_report(Published(sched))["scheduler"]["decode_batch"]
    assert batch["replays"] == batch["padded_rows"] == 0 and not any(batch["replays_by_slots"].values())
    assert batch["rows"] == 3 * (MAX_TOKENS - 1)


def test_replay_sizes_past_16_get_their_own_key() -> None:
    stats = ReplayStats()
    stats.record(24, 17)
    stats.record(4, 4)
    by_slots = stats.as_metrics()["replays_by_slots"]
    assert by_slots["24"] == 1 and by_slots["4"] == 1 and len(by_slots) == 17
    assert stats.padded_rows == 7


def test_prometheus_renders_the_decode_batch_counters(tiny_model) -> None:
    sched = _scheduler(tiny_model, graphs=True)
    _serve(sched, tiny_model.info.vocab_size)
    loop = StepLoop(sched, 10.0, vocab_size=tiny_model.info.vocab_size, gather_ms=0)
    loop._publish()
    counters = SimpleNamespace(
        requests_total=0, requests_failed=0, tokens_out=0, rejects_bad=0, tool_calls_out=0
    )
    engine = SimpleNamespace(
        published=loop.published,
        inbox=loop.inbox,
        counters=counters,
        model_id="m",
        limits=SimpleNamespace(kv_pool_tokens=1),
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(engine))
    text = generate_latest(registry).decode()
    steps = MAX_TOKENS - 1
    assert f'dgpp_decode_batch_replays_total{{model_name="m"}} {float(steps)}' in text
    assert f'dgpp_decode_batch_padded_rows_total{{model_name="m"}} {float(steps)}' in text
    assert f'dgpp_decode_batch_rows_total{{model_name="m"}} {float(3 * steps)}' in text
    assert f'dgpp_decode_batch_replays_by_slots_total{{model_name="m",slots="4"}} {float(steps)}' in text
    assert 'dgpp_decode_batch_last_rows_per_request{model_name="m"} 1.0' in text
    request_s = sched.stats.prefill_request_ms / 1000.0
    assert f'dgpp_prefill_request_seconds_total{{model_name="m"}} {request_s}' in text
