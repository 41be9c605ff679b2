"""``/metrics`` is built when scraped from what the step loop publishes (counters, and gauges written once per
pass), never from the scheduler itself: a reader on the HTTP thread walks nothing the step thread is changing."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.sched.step_loop import StepLoop
from dgpp.serve.metrics import _Collector, metrics_json
from dgpp.testing.scheduler import scheduler_config
from dgpp.testing.toy_runner import ToyRunner

VOCAB = 32


def _request(rid: str, prompt_len: int) -> list[Sequence]:
    p = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = list(range(1, prompt_len + 1))
    return [
        Sequence(
            rid, 0, prompt, p, ChoiceSampler(p, VOCAB, prompt), lambda s, ev: None, use_prefix_cache=False
        )
    ]


def _loop() -> tuple[Scheduler, StepLoop]:
    conf = scheduler_config(
        block_size=4, chunk_tokens=8, idle_chunks=2, max_concurrency=2, prefix_cache=False
    )
    pool = BlockPool(32, 4)
    sched = Scheduler(conf, ToyRunner(VOCAB, 32, 4, 2), pool, SlotPool(2, 0), PrefixCache(pool, 8))
    return sched, StepLoop(sched, stats_interval_s=0, vocab_size=VOCAB, gather_ms=0)


def _http_side(loop: StepLoop) -> SimpleNamespace:
    """What the HTTP side holds of the step loop: its publication and the inbox's hand-off counts, no
    scheduler."""
    counters = SimpleNamespace(
        requests_total=0, requests_failed=0, tokens_out=0, rejects_bad=0, tool_calls_out=0
    )
    return SimpleNamespace(
        published=loop.published,
        inbox=loop.inbox,
        counters=counters,
        model_id="m",
        limits=SimpleNamespace(kv_pool_tokens=128),
    )


def test_metrics_report_the_last_published_pass_and_read_no_scheduler() -> None:
    sched, loop = _loop()
    for i, n in enumerate(
        (3, 20, 3)
    ):  # r1's 20 tokens prefill over three 8-token chunks; r2 waits for a slot
        sched.submit(_request(f"r{i}", n))
    sched.tick()  # the step loop's thread: a pass, then its publication
    loop._publish()
    m = metrics_json(_http_side(loop))
    sch = m["scheduler"]
    assert (sch["active"], sch["queued"], sch["prefilling"]) == (2, 1, 1)
    assert sch["decode_batch"]["last_active"] == 1
    assert sch["pool_blocks_total"] == 32 and sch["pool_blocks_in_use"] == len(
        sched.live[0].block_table
    ) + len(sched.live[1].block_table)
    (row,) = m["prefill"]["requests"]
    assert (row["id"], row["prompt_tokens"], row["processed_tokens"], row["remaining_tokens"]) == (
        "r1",
        20,
        8,
        12,
    )
    assert sch["tokens_generated"] == sched.stats.tokens_generated == 1

    sched.tick()  # a pass not yet published: the gauges stay those of the last publication
    assert metrics_json(_http_side(loop))["prefill"]["requests"][0]["processed_tokens"] == 8
    loop._publish()
    assert metrics_json(_http_side(loop))["prefill"]["requests"][0]["processed_tokens"] == 16

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(_http_side(loop)))
    text = generate_latest(registry).decode()
    assert 'dgpp_num_requests_running{model_name="m"} 2.0' in text
    assert 'dgpp_num_requests_waiting{model_name="m"} 1.0' in text
