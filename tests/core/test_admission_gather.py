"""An idle engine admits a burst in one tick: it holds the first arrival until arrivals pause for
``engine.admission_gather_ms`` (at most ``admission_gather_max_ms``), and a short prompt is tokenized on the
event loop rather than queued for the preparation pool."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from dgpp.config import parse_config
from dgpp.engine.work import SeqWork
from dgpp.sample import SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.scheduler import Scheduler
from dgpp.sched.step_loop import StepLoop
from dgpp.sched.thread_handoff import GenerationRequest
from dgpp.serve.backend import INLINE_PREP_CHARS
from dgpp.server_assembly import build_backend
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.scheduler import scheduler_config
from dgpp.testing.tokenizers import build_tiny_tokenizer

VOCAB = 16


class _StopAfterFirstTick:
    """Records how many requests the first tick admitted, then fails the step (ending every request)."""

    def step(self, works: list[SeqWork]) -> torch.Tensor:
        raise RuntimeError("first tick recorded")


def _recording_loop(gather_ms: int, gather_max_ms: int) -> tuple[StepLoop, list[int], threading.Event]:
    """A started step loop whose first tick records how many requests it admitted (then its step fails)."""
    conf = scheduler_config(block_size=4, chunk_tokens=8, max_concurrency=64)
    pool = BlockPool(256, 4)
    sched = Scheduler(
        conf, _StopAfterFirstTick(), pool, SlotPool(conf.max_concurrency, 0), PrefixCache(pool, 8)
    )
    sizes: list[int] = []
    first = threading.Event()

    class FirstTickSize:
        def recording(self, sink):
            return sink

        def before_tick(self, inbox, cancels) -> None:
            sizes.append(len(inbox))
            first.set()

        def after_tick(self) -> None:
            pass

    loop = StepLoop(
        sched,
        stats_interval_s=0,
        vocab_size=VOCAB,
        gather_ms=gather_ms,
        gather_max_ms=gather_max_ms,
        journal=FirstTickSize(),
    )
    loop.start()
    return loop, sizes, first


def _submit(loop: StepLoop, i: int) -> None:
    request = GenerationRequest(f"r{i}", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=2))
    loop.inbox.submit(request, lambda s, ev: None)


def _first_tick_size(gather_ms: int, gather_max_ms: int, arrivals: int, gap_s: float) -> int:
    loop, sizes, first = _recording_loop(gather_ms, gather_max_ms)
    try:
        for i in range(arrivals):
            if first.is_set():
                break
            _submit(loop, i)
            time.sleep(gap_s)
        assert first.wait(10)
    finally:
        loop.stop()
    return sizes[0]


def test_a_burst_longer_than_the_quiet_gap_is_admitted_in_one_tick():
    # 12 arrivals 10 ms apart: 110 ms in all, never a 50 ms pause; a fixed 50 ms hold took the first ~5 only
    assert _first_tick_size(50, 1000, arrivals=12, gap_s=0.01) == 12


def test_the_hold_ends_at_its_cap_however_requests_keep_arriving():
    # arrivals 10 ms apart for 300 ms; the hold stops at 120 ms
    assert _first_tick_size(50, 120, arrivals=30, gap_s=0.01) < 30


def test_the_hold_waits_for_a_request_announced_on_its_way():
    """``expect`` (a request being read and tokenized on the event loop) keeps the idle engine holding past the
    quiet gap until that request is submitted."""
    loop, sizes, first = _recording_loop(5, 5000)
    try:
        loop.inbox.expect()
        _submit(loop, 0)
        time.sleep(0.2)  # 40 quiet gaps: without the announcement the first tick took request 0 alone
        _submit(loop, 1)
        loop.inbox.unexpect()
        assert first.wait(10)
    finally:
        loop.stop()
    assert sizes[0] == 2


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    ckpt = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("gather") / "qwen3")
    build_tiny_tokenizer(ckpt)
    engine = build_backend(
        parse_config({"model": str(ckpt), "engine": {"stats_interval_s": 0, "admission_gather_max_ms": 50}}),
        device="cpu",
    )
    yield engine
    engine.shutdown()


class _RefusingPool:
    """Stands in for the preparation pool: any job sent to it fails, so a prompt that reaches it is seen."""

    def submit(self, *args, **kwargs):
        raise RuntimeError("sent to the preparation pool")


def test_short_prompts_are_tokenized_on_the_event_loop_long_ones_in_the_pool(backend, monkeypatch):
    short = "hello world " * 10
    expected = backend.tokenizer.encode(short)
    monkeypatch.setattr(backend, "_prep", _RefusingPool())
    assert asyncio.run(backend.prepare_text(short)) == expected
    with pytest.raises(RuntimeError, match="preparation pool"):
        asyncio.run(backend.prepare_text("x" * (INLINE_PREP_CHARS + 1)))


def test_every_announcement_is_released_answered_or_refused(backend, monkeypatch):
    """A refused request (400) and an answered one leave no announcement behind: a leaked one would hold every
    later idle admission for ``admission_gather_max_ms``."""
    from litestar.testing import TestClient

    from dgpp.serve.app import build_app

    announced = []
    expect = backend.inbox.expect
    monkeypatch.setattr(backend.inbox, "expect", lambda: (announced.append(1), expect()))
    with TestClient(build_app(backend)) as client:
        bad = client.post(
            "/v1/completions", json={"model": backend.model_id, "prompt": "hi", "temperature": -1}
        )
        good = client.post(
            "/v1/completions", json={"model": backend.model_id, "prompt": "hello", "max_tokens": 2}
        )
    assert bad.status_code == 400 and good.status_code == 200
    assert len(announced) == 2 and backend.inbox.expected == 0


def test_requests_are_announced_only_where_the_hold_waits_for_them():
    """With the plain hold (``admission_gather_max_ms`` 0, the default) announcing is moot, so a handler takes no
    step loop lock for it."""
    conf = scheduler_config(block_size=4, chunk_tokens=8)
    pool = BlockPool(16, 4)

    def loop(gather_max_ms: int) -> StepLoop:
        sched = Scheduler(
            conf, _StopAfterFirstTick(), pool, SlotPool(conf.max_concurrency, 0), PrefixCache(pool, 8)
        )
        return StepLoop(sched, stats_interval_s=0, vocab_size=VOCAB, gather_ms=3, gather_max_ms=gather_max_ms)

    assert not loop(0).inbox.waits_for_announced and not loop(3).inbox.waits_for_announced
    assert loop(50).inbox.waits_for_announced
