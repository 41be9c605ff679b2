"""Scheduler tick on a toy runner: batching invariance, chunk boundaries, prefix hits, cancels, admission."""

from __future__ import annotations

import pytest

from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import RetireReason, SeqEvent, Sequence
from dgpp.sched.scheduler import QueueFull, Scheduler
from dgpp.testing.scheduler import scheduler_config
from dgpp.testing.toy_runner import ToyRunner

VOCAB, BS, CHUNK = 48, 4, 8


def build(
    hybrid: bool = False, num_blocks: int = 64, attach: int | None = None, **cfg
) -> tuple[Scheduler, ToyRunner]:
    conf = scheduler_config(block_size=BS, chunk_tokens=CHUNK, **cfg)
    runner = ToyRunner(VOCAB, num_blocks, BS, conf.max_concurrency + 4, hybrid=hybrid)
    pool = BlockPool(num_blocks, BS)
    slots = SlotPool(conf.max_concurrency, 4)
    cache = PrefixCache(
        pool,
        CHUNK,
        hybrid=hybrid,
        slots=slots,
        copy_state=runner.copy_state,
        enabled=conf.prefix_cache,
        attach=attach,
    )
    return Scheduler(conf, runner, pool, slots, cache, eos_token_ids={0}), runner


def seq(
    rid: str, prompt: list[int], events: dict, max_tokens: int = 6, choice: int = 0, **params
) -> Sequence:
    p = SamplingParams(temperature=params.pop("temperature", 0.0), max_tokens=max_tokens, **params)

    def sink(s: Sequence, ev: SeqEvent) -> None:
        events.setdefault((rid, choice), []).append(ev)

    return Sequence(rid, choice, prompt, p, ChoiceSampler(p, VOCAB, prompt, choice), sink)


def run(sched: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not sched.has_work:
            return
        sched.tick()
    raise AssertionError("scheduler did not drain")


def tokens(events: dict, key) -> list[int]:
    return [t for ev in events[key] for t in ev.tokens]


PROMPTS = [list(range(1, 1 + n)) for n in (3, 11, 17, 25)] + [[5, 9, 2, 7, 7, 7, 1, 3, 30, 31]]


def alone(prompt: list[int], **cfg) -> list[int]:
    sched, _ = build(**cfg)
    ev: dict = {}
    sched.submit([seq("a", prompt, ev, ignore_eos=True)])
    run(sched)
    return tokens(ev, ("a", 0))


@pytest.mark.parametrize("hybrid", [False, True])
def test_concurrent_outputs_equal_solo_outputs(hybrid: bool) -> None:
    solo = [alone(p, hybrid=hybrid) for p in PROMPTS]
    sched, runner = build(hybrid=hybrid, max_concurrency=3, idle_chunks=2)
    ev: dict = {}
    for i, p in enumerate(PROMPTS):
        sched.submit([seq(str(i), p, ev, ignore_eos=True)])
    run(sched)
    assert [tokens(ev, (str(i), 0)) for i in range(len(PROMPTS))] == solo
    # every prefill chunk starts at a multiple of the chunk size (decode rows feed one token)
    for step in runner.steps:
        for ctx, n in step:
            assert n == 1 or ctx % CHUNK == 0
    assert sched.blocks.num_in_use == sched.prefix_cache.blocks_pinned + 0  # only the cache holds blocks now


@pytest.mark.parametrize("hybrid", [False, True])
def test_prefix_hit_returns_cold_tokens(hybrid: bool) -> None:
    shared = list(range(10, 30))  # 20 tokens: cuts at 8 and 16
    a, b = shared + [1, 2, 3], shared + [4, 5]
    cold_b = alone(b, hybrid=hybrid)
    sched, _ = build(hybrid=hybrid)
    ev: dict = {}
    sched.submit([seq("a", a, ev, ignore_eos=True)])
    run(sched)
    sched.submit([seq("b", b, ev, ignore_eos=True)])
    run(sched)
    assert tokens(ev, ("b", 0)) == cold_b
    assert ev[("b", 0)][0].cached_tokens == 16
    assert ev[("a", 0)][0].cached_tokens == 0
    assert sched.prefix_cache.stats.hits == 1
    if hybrid:
        assert sched.prefix_cache.num_snapshots == 1  # a's deepest cut; b attached there
    # a prompt that equals a cached prefix exactly still recomputes its last token: attach at cut 8,
    # which a hybrid model can only do where a snapshot exists (none at 8 yet)
    sched.submit([seq("c", shared[:16], ev, ignore_eos=True)])
    run(sched)
    assert ev[("c", 0)][0].cached_tokens == (0 if hybrid else 8)
    assert tokens(ev, ("c", 0)) == alone(shared[:16], hybrid=hybrid)


def test_block_granularity_hit_returns_cold_tokens() -> None:
    """With ``attach`` at the block size (prefill rows independent of chunking), a prompt shorter than a chunk
    and a prompt diverging between cuts attach at their last shared full block; tokens equal a cold run."""
    shared = list(range(10, 24))  # 14 tokens
    a, b, c = shared + [1, 2, 3], shared + [4, 5], shared[:6] + [9, 9, 9]
    sched, runner = build(attach=BS)
    ev: dict = {}
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        sched.submit([seq(rid, prompt, ev, ignore_eos=True)])
        run(sched)
        assert tokens(ev, (rid, 0)) == alone(prompt), rid
    # a: cold; b: blocks 0-2 (12 tokens, between cuts 8 and 16); c: block 0 only (diverges inside block 1)
    assert [ev[(r, 0)][0].cached_tokens for r in "abc"] == [0, 12, 4]
    prefill_starts = [ctx for step in runner.steps for ctx, n in step if n > 1]
    assert 12 in prefill_starts and 4 in prefill_starts  # suffix prefills start at blocks, not only at cuts
    d = b + [7, 7]
    sched.submit([seq("d", d, ev, ignore_eos=True)])
    run(sched)
    # b's last block (tokens 12..15, ending its prompt, not at a cut) was indexed when its prefill ended
    assert ev[("d", 0)][0].cached_tokens == 16 and tokens(ev, ("d", 0)) == alone(d)


def test_cancel_frees_slot_and_blocks() -> None:
    sched, _ = build(max_concurrency=1, prefix_cache=False)
    ev: dict = {}
    sched.submit([seq("long", list(range(1, 10)), ev, max_tokens=50, ignore_eos=True)])
    sched.submit([seq("next", [3, 4, 5], ev, max_tokens=3, ignore_eos=True)])
    for _ in range(4):
        sched.tick()
    assert [s.request_id for s in sched.live] == ["long"]
    sched.cancel("long")
    run(sched)
    assert ev[("long", 0)][-1].retired is RetireReason.CANCELLED
    assert ev[("next", 0)][-1].retired is RetireReason.LENGTH and len(tokens(ev, ("next", 0))) == 3
    assert sched.blocks.num_in_use == 0 and len(sched.slots.live_free) == 1


def test_eos_stops_unless_ignored_and_queue_limit() -> None:
    sched, _ = build(queue_limit=2)
    ev: dict = {}
    sched.submit([seq("e", [1, 2, 3], ev, max_tokens=40, logit_bias={0: 5.0})])
    run(sched)
    assert tokens(ev, ("e", 0))[-1] == 0 and ev[("e", 0)][-1].retired is RetireReason.EOS
    group = [seq("q1", [1], ev, choice=i) for i in range(3)]
    for follower in group[1:]:
        follower.leader = group[0]
    sched.submit(group)  # one request of three choices counts once against queue_limit
    sched.submit([seq("q2", [2], ev)])
    with pytest.raises(QueueFull):
        sched.submit([seq("q3", [3], ev)])


def test_grow_admission_sheds_youngest_when_pool_runs_out() -> None:
    sched, _ = build(num_blocks=10, admission="grow", admission_window=4, prefix_cache=False)
    ev: dict = {}
    sched.submit([seq("old", [1, 2, 3, 4], ev, max_tokens=30, ignore_eos=True)])
    sched.submit([seq("young", [5, 6, 7, 8], ev, max_tokens=30, ignore_eos=True)])
    run(sched)
    assert ev[("young", 0)][-1].retired is RetireReason.POOL_EXHAUSTED
    assert ev[("old", 0)][-1].retired in (RetireReason.LENGTH, RetireReason.POOL_EXHAUSTED)
    assert sched.stats.reservations_grown > 0 and sched.blocks.num_in_use == 0


def test_full_admission_waits_for_room_oldest_that_fits_first() -> None:
    sched, _ = build(num_blocks=8)
    ev: dict = {}
    sched.submit([seq("big", [1] * 8, ev, max_tokens=20, ignore_eos=True)])  # 7 blocks
    sched.submit([seq("huge", [2] * 8, ev, max_tokens=20, ignore_eos=True)])  # must wait
    sched.submit([seq("small", [3] * 2, ev, max_tokens=2, ignore_eos=True)])  # 1 block: passes huge
    sched.tick()
    assert [s.request_id for s in sched.live] == ["big", "small"]
    run(sched)
    assert len(tokens(ev, ("huge", 0))) == 20
    # "huge" was tried on several ticks before it fitted: the cache counted one lookup for it, not one a tick
    stats = sched.prefix_cache.stats
    assert stats.hits + stats.misses == 3


def test_stats_line_has_the_original_engines_shape() -> None:
    import time

    from dgpp.sched.published import StatsLine

    sched, _ = build()
    line = StatsLine(sched, interval_s=0.01)
    ev: dict = {}
    sched.submit([seq("a", list(range(1, 20)), ev, max_tokens=5, ignore_eos=True)])
    run(sched)
    time.sleep(0.02)
    text = line.maybe_log(idle=False)
    assert text is not None and text.startswith("stats: decode ")
    for part in (
        "tok/s",
        "ms/step (4 steps / 4 tok",
        "| prefill ",
        "cached 0 (0/1 hits)",
        "| live 0, queued 0",
        f"| pool {sched.blocks.num_in_use}/64 blocks",
        "| requests +1 (shed 0, cancelled 0)",
    ):
        assert part in text, part
    assert line.maybe_log(idle=True) is None  # nothing new: no line


def test_n_choices_compute_the_shared_prompt_once() -> None:
    prompt = list(range(3, 30))  # 27 tokens: deepest cut 24
    sched, runner = build()
    ev: dict = {}
    choices = [seq("n", prompt, ev, choice=i, temperature=1.0, seed=11, ignore_eos=True) for i in range(3)]
    for follower in choices[1:]:
        follower.leader = choices[0]
    sched.submit(choices)
    run(sched)
    assert [ev[("n", i)][0].cached_tokens for i in range(3)] == [0, 24, 24]
    prefilled = sum(n for step in runner.steps for _, n in step if n > 1)
    assert prefilled == 27 + 2 * 3  # the leader's whole prompt, then each follower's 3-token suffix
    for i in range(3):  # each choice equals the same choice computed alone
        solo_sched, _ = build()
        solo: dict = {}
        solo_sched.submit([seq("n", prompt, solo, choice=i, temperature=1.0, seed=11, ignore_eos=True)])
        run(solo_sched)
        assert tokens(ev, ("n", i)) == tokens(solo, ("n", i))


def test_hybrid_body_cut_serves_a_changed_question_after_a_long_document() -> None:
    document = list(range(100, 140))  # 40 tokens = 5 chunks
    first, second = document + [1, 2, 3, 4, 5, 6, 7], document[:36] + [9, 9, 9, 9, 9, 9, 9]
    cold = alone(second, hybrid=True)
    sched, _ = build(hybrid=True)
    ev: dict = {}
    sched.submit([seq("a", first, ev, ignore_eos=True)])
    run(sched)
    assert sched.prefix_cache.num_snapshots == 2  # deepest cut 40 and body cut 24
    sched.submit([seq("b", second, ev, ignore_eos=True)])
    run(sched)
    assert ev[("b", 0)][0].cached_tokens == 24 and tokens(ev, ("b", 0)) == cold


def test_a_burst_of_short_prompts_shares_forwards_by_token_budget() -> None:
    """The prefill budget counts tokens: eight 3-token prompts fit one 16-token idle budget five at a time
    (3 * 5 = 15), instead of one prompt per chunk of budget; outputs still equal each prompt run alone."""
    prompts = [[7 + i, 20 + i, 3] for i in range(8)]
    solo = [alone(p) for p in prompts]
    sched, runner = build(max_concurrency=8, idle_chunks=2, busy_chunks=1)
    ev: dict = {}
    for i, p in enumerate(prompts):
        sched.submit([seq(str(i), p, ev, ignore_eos=True)])
    sched.tick()
    first = runner.steps[0]
    assert [n for _, n in first] == [3] * 5  # idle: 16 tokens of budget, five 3-token prompts
    sched.tick()  # busy: 8 tokens of budget -> two more prompts ride along with the five decode rows
    assert sorted(n for _, n in runner.steps[1]) == [1] * 5 + [3, 3]
    run(sched)
    assert [tokens(ev, (str(i), 0)) for i in range(len(prompts))] == solo
