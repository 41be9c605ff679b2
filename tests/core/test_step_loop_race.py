"""Submissions from many threads while the step loop ticks: no thread reads a structure another one mutates.

The HTTP side enforces ``engine.queue_limit`` when it submits, while the step loop thread appends to and admits
from the scheduler's queue. With a short GIL switch interval a submission that walked the scheduler's queue
raced those changes (``RuntimeError: deque mutated during iteration``), which reached the client as a 500.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from dgpp.config import EngineConfig
from dgpp.sample import SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import SeqEvent, Sequence
from dgpp.sched.scheduler import QueueFull, Scheduler
from dgpp.sched.step_loop import StepLoop
from dgpp.sched.thread_handoff import GenerationRequest
from dgpp.serve.errors import APIError
from dgpp.testing.scheduler import scheduler_config
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.testing.toy_backend import build_toy_backend
from dgpp.testing.toy_runner import ToyRunner

VOCAB = 32
THREADS = 4
QUEUE_LIMIT = 2000  # a long queue: walking it took long enough for the step loop to change it meanwhile
DURATION_S = 4.0  # the race showed within 0.2-1 s on a 2-core machine


class _Retired:
    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self.all_done = threading.Event()
        self.expected = -1

    def sink(self, s: Sequence, ev: SeqEvent) -> None:
        if ev.retired is None:
            return
        with self._lock:
            self.count += 1
            if self.count == self.expected:
                self.all_done.set()


def _request(rid: str, n: int) -> GenerationRequest:
    # two choices on some requests: the limit counts requests, not choices
    return GenerationRequest(rid, (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=1), n, False)


def test_submissions_from_many_threads_never_race_the_step_loop() -> None:
    conf = scheduler_config(
        block_size=4, chunk_tokens=8, max_concurrency=1, queue_limit=QUEUE_LIMIT, prefix_cache=False
    )
    pool = BlockPool(64, 4)
    slots = SlotPool(conf.max_concurrency, 0)
    sched = Scheduler(conf, ToyRunner(VOCAB, 64, 4, conf.max_concurrency), pool, slots, PrefixCache(pool, 8))
    loop = StepLoop(sched, stats_interval_s=0, vocab_size=VOCAB, gather_ms=0)
    retired = _Retired()
    accepted: list[int] = [0] * THREADS
    shed: list[int] = [0] * THREADS
    errors: list[BaseException] = []
    go = threading.Barrier(THREADS)

    def submitter(t: int) -> None:
        go.wait()
        deadline = time.monotonic() + DURATION_S
        k = 0
        while time.monotonic() < deadline and not errors:
            k += 1
            n = 1 + (k % 2)
            try:
                loop.inbox.submit(_request(f"t{t}-{k}", n), retired.sink)
                accepted[t] += n
            except QueueFull:
                shed[t] += 1
            except Exception as exc:  # the race: anything but QueueFull is a bug
                errors.append(exc)

    interval = sys.getswitchinterval()
    loop.start()  # sets the engine's own 0.5 ms interval; the test shortens it further
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        retired.expected = sum(accepted)
        if retired.count == retired.expected:
            retired.all_done.set()
        assert not errors, f"{len(errors)} submissions raised: {errors[0]!r}"
        assert retired.all_done.wait(60), f"{retired.count} of {retired.expected} accepted choices retired"
        assert sum(accepted) > 0
        assert loop.failed is None
    finally:
        sys.setswitchinterval(interval)
        loop.stop()


def test_backend_submissions_from_many_event_loops_answer_only_overloaded(tmp_path) -> None:
    """``Backend.submit`` under the same race: every submission is queued or refused 503 ``overloaded``, never an
    exception the route would turn into a 500."""
    backend = build_toy_backend(
        "toy/model",
        build_tiny_tokenizer(tmp_path),
        EngineConfig(
            kv_capacity=4096,
            block_size=4,
            max_concurrency=1,
            queue_limit=QUEUE_LIMIT,
            prefix_cache_gib=0,
            stats_interval_s=0,
            admission_gather_ms=0,
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    outcomes: list[str] = []
    errors: list[BaseException] = []
    go = threading.Barrier(THREADS)

    async def submit_until(deadline: float) -> None:
        while time.monotonic() < deadline and not errors:
            try:
                backend.submit(GenerationRequest("cmpl-race", (5, 6, 7), params, 1 + len(outcomes) % 2))
                outcomes.append("queued")
            except APIError as e:
                if (e.status, e.code) != (503, "overloaded"):
                    errors.append(e)
                outcomes.append("shed")
            except Exception as exc:  # the race: anything but a 503 would answer 500
                errors.append(exc)

    def submitter() -> None:
        go.wait()
        asyncio.run(submit_until(time.monotonic() + DURATION_S / 2))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=submitter) for _ in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        sys.setswitchinterval(interval)
        backend.shutdown()
    assert not errors, f"{len(errors)} submissions raised: {errors[0]!r}"
    assert "queued" in outcomes
