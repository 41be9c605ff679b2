"""A runner failure ends every request, including one submitted while the failing tick ran."""

from __future__ import annotations

import threading

import torch

from dgpp.engine.work import SeqWork
from dgpp.sample import SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import RetireReason, SeqEvent, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.sched.step_loop import StepLoop
from dgpp.sched.thread_handoff import GenerationRequest
from dgpp.testing.scheduler import scheduler_config

VOCAB = 16


class _Events:
    def __init__(self) -> None:
        self.by_request: dict[str, list[SeqEvent]] = {}
        self.ended = threading.Event()

    def sink(self, s: Sequence, ev: SeqEvent) -> None:
        self.by_request.setdefault(s.request_id, []).append(ev)
        if len(self.by_request) == 2 and all(e[-1].retired for e in self.by_request.values()):
            self.ended.set()


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=4))


class _FailingRunner:
    """Submits a second request from inside the step (as the HTTP thread could), then fails."""

    loop: StepLoop
    events: _Events

    def step(self, works: list[SeqWork]) -> torch.Tensor:
        self.loop.inbox.submit(_request("late"), self.events.sink)
        raise RuntimeError("device lost")


def test_request_submitted_during_a_failing_tick_is_ended_not_left_waiting() -> None:
    conf = scheduler_config(block_size=4, chunk_tokens=8)
    pool = BlockPool(16, 4)
    slots = SlotPool(conf.max_concurrency, 0)
    runner = _FailingRunner()
    sched = Scheduler(conf, runner, pool, slots, PrefixCache(pool, 8))
    loop = StepLoop(sched, stats_interval_s=0, vocab_size=VOCAB, gather_ms=0)
    events = _Events()
    runner.loop, runner.events = loop, events
    loop.start()
    try:
        loop.inbox.submit(_request("first"), events.sink)
        assert events.ended.wait(10), f"a request never got its failure event: {sorted(events.by_request)}"
    finally:
        loop.stop()
    for rid in ("first/0", "late/0"):
        last = events.by_request[rid][-1]
        assert last.retired is RetireReason.FAILED and "device lost" in (last.error or "")
