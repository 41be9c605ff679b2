"""Overlapped decode steps (dgpp.sched.overlap): the same tokens as without overlap, whatever ends a request."""

from __future__ import annotations

import pytest
import torch

from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import RetireReason, SeqEvent, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.testing.scheduler import scheduler_config
from dgpp.testing.toy_runner import ToyRunner

VOCAB, BS, CHUNK = 48, 4, 8


class CountingRunner(ToyRunner):
    """Counts the steps fed from device ids (overlapped) and checks each such step's rows are decode rows."""

    fed = 0

    def step(self, works, input_ids=None):
        if input_ids is not None:
            self.fed += 1
            assert all(len(w.token_ids) == 1 for w in works) and input_ids.shape == (len(works),)
        return super().step(works, input_ids)


def build(overlap: bool, hybrid: bool = False) -> tuple[Scheduler, CountingRunner]:
    conf = scheduler_config(block_size=BS, chunk_tokens=CHUNK, max_concurrency=4, max_position=60)
    runner = CountingRunner(VOCAB, 96, BS, conf.max_concurrency + 4, hybrid=hybrid, favour={0: 1.5})
    pool, slots = BlockPool(96, BS), SlotPool(conf.max_concurrency, 4)
    cache = PrefixCache(pool, CHUNK, hybrid=hybrid, slots=slots, copy_state=runner.copy_state, enabled=True)
    sched = Scheduler(conf, runner, pool, slots, cache, eos_token_ids={0})
    sched.overlap_steps = overlap
    return sched, runner


def request(rid: str, prompt: list[int], events: dict, **params) -> Sequence:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 9, **params})

    def sink(s: Sequence, ev: SeqEvent) -> None:
        events.setdefault(rid, []).append(ev)

    return Sequence(rid, 0, prompt, p, ChoiceSampler(p, VOCAB, prompt), sink)


# greedy and seeded sampling, EOS honoured or ignored, different lengths, a penalty (drains every step), a prompt
# close to max_position (ends on the position limit)
CASES = [
    ("g1", list(range(1, 12)), {}),
    ("g2", list(range(5, 9)), {"ignore_eos": True, "max_tokens": 14}),
    ("s1", list(range(20, 31)), {"temperature": 0.9, "seed": 7, "max_tokens": 12}),
    ("s2", [3, 1, 4, 1, 5], {"temperature": 0.7, "top_k": 5, "seed": 3, "ignore_eos": True}),
    ("p1", [9, 9, 8], {"repetition_penalty": 1.3, "ignore_eos": True, "max_tokens": 6}),
    ("long", list(range(1, 48)), {"ignore_eos": True, "max_tokens": 30}),
    ("late", [2, 7, 1, 8, 2, 8], {"temperature": 0.8, "seed": 11, "max_tokens": 16}),
]


def serve(
    overlap: bool, hybrid: bool = False, cancel_at: int | None = None
) -> tuple[dict, Scheduler, CountingRunner]:
    sched, runner = build(overlap, hybrid)
    events: dict = {}
    for rid, prompt, params in CASES[:-1]:
        sched.submit([request(rid, prompt, events, **params)])
    for tick in range(400):
        if tick == 5:  # an arrival while the others decode
            rid, prompt, params = CASES[-1]
            sched.submit([request(rid, prompt, events, **params)])
        if tick == cancel_at:
            sched.cancel("g2")
        if not sched.has_work and tick > 5:
            break
        sched.tick()
    return events, sched, runner


def outcome(events: dict) -> dict:
    return {
        rid: ([t for ev in evs for t in ev.tokens], [ev.retired for ev in evs if ev.retired])
        for rid, evs in events.items()
    }


@pytest.mark.parametrize("hybrid", [False, True])
def test_overlapped_steps_give_the_same_tokens(hybrid: bool) -> None:
    plain, _, off = serve(False, hybrid)
    overlapped, sched, on = serve(True, hybrid)
    assert outcome(overlapped) == outcome(plain)
    assert off.fed == 0 and on.fed > 10  # the overlapped run fed most decode steps from device ids
    reasons = {r for _, rs in outcome(plain).values() for r in rs}
    assert {RetireReason.EOS, RetireReason.LENGTH} <= reasons
    assert sched.blocks.num_in_use == sched.prefix_cache.blocks_pinned and not sched.live


def test_cancel_while_a_step_is_in_flight() -> None:
    plain, _, _ = serve(False, cancel_at=9)
    overlapped, sched, _ = serve(True, cancel_at=9)
    assert outcome(overlapped) == outcome(plain)
    assert outcome(plain)["g2"][1] == [RetireReason.CANCELLED]
    assert not sched.live and sched._inflight is None


def test_model_runner_feeds_device_ids_like_token_ids() -> None:
    """``ModelRunner.step(works, input_ids=...)`` computes what the works' own tokens compute (tiny Qwen3, CPU)."""
    from dgpp.bench.models import build_pair
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.step.pools import CachePools

    model, _ = build_pair("tiny", "cpu", torch.float32, with_hf=False)
    pools = CachePools(model.cache_spec(), 16, 16, 4, device="cpu")
    runner = ModelRunner(model, pools)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    runner.step([SeqWork(b, tables[b], 0, [5 + b, 9, 11, 2 + b]) for b in range(2)])
    own = runner.step([SeqWork(b, tables[b], 4, [30 + b]) for b in range(2)])
    fed = runner.step([SeqWork(b, tables[b], 4, [0]) for b in range(2)], input_ids=torch.tensor([30, 31]))
    assert torch.equal(own, fed)
    other = runner.step([SeqWork(b, tables[b], 4, [0]) for b in range(2)])
    assert not torch.equal(own, other)  # the placeholder token was not what the fed step computed
    with pytest.raises(ValueError, match="input_ids"):
        runner.step([SeqWork(0, tables[0], 4, [1, 2])], input_ids=torch.tensor([3]))
