"""Block drafter (``dgpp.engine.block_draft``) tests of any family: the drafter's context filled from the target's
prefill (``prefill_features``), and greedy serving through the scheduler with the drafter or without
(``serve_greedy``), whose transcripts are compared with a plain run's."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from dgpp.engine.block_draft import BlockDraftDecoder
from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.verify_schedule import ScheduleSettings
from dgpp.engine.work import SeqWork
from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import SeqEvent, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.step.model import BlockDrafter, Model
from dgpp.step.pools import CachePools
from dgpp.testing.scheduler import scheduler_config


def prefill_features(
    model: Model, drafter: BlockDrafter, prompts: Seq[list[int]], *, blocks: int, block_size: int, spare: int
) -> tuple[CachePools, list[list[int]], list[torch.Tensor]]:
    """Each prompt prefilled by the target in slot ``i`` (its ``last_hidden`` kept as the features), then every
    row written into the drafter's context; each block table covers the prompt and ``spare`` tokens more.
    Returns the drafter's pools, the block tables and each prompt's features."""
    pools = CachePools(model.cache_spec(), blocks, block_size, 8)
    draft_pools = CachePools(drafter.cache_spec(), blocks, block_size, 8)
    runner = ModelRunner(model, pools)
    model.keep_hidden = True
    tables: list[list[int]] = []
    features: list[torch.Tensor] = []
    at = 0
    try:
        for slot, prompt in enumerate(prompts):
            table = list(range(at, at + -(-(len(prompt) + spare) // block_size)))
            at += len(table)
            runner.step([SeqWork(slot, table, 0, prompt)])
            assert model.last_hidden is not None
            features.append(model.last_hidden.clone())
            drafter.absorb(build_batch([SeqWork(slot, table, 0, prompt)], draft_pools), features[-1])
            tables.append(table)
    finally:
        model.keep_hidden = False
    return draft_pools, tables, features


def serve_greedy(
    model: Model,
    drafter: BlockDrafter | None = None,
    depth: int = 1,
    *,
    prompts: Seq[list[int]],
    max_tokens: Seq[int],
    blocks: int,
    block_size: int,
    chunk: int = 8,
    concurrency: int = 3,
    schedule: ScheduleSettings | None = None,
    wrap: Callable[[BlockDrafter, Scheduler], BlockDrafter] | None = None,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Serves every prompt greedily (request ``r{i}`` for ``prompts[i]``, ``max_tokens[i]`` tokens) on a fresh
    scheduler over ``blocks`` cache blocks of ``block_size``, verifying ``drafter``'s blocks ``depth`` drafts deep
    when given (``wrap`` may replace it with one that sees the scheduler). Returns each request's tokens and the
    drained scheduler (its counters); fails on an errored request or one left unfinished after 600 ticks."""
    conf = scheduler_config(
        block_size=block_size, chunk_tokens=chunk, max_concurrency=concurrency, queue_limit=4096
    )
    pools = CachePools(model.cache_spec(), blocks, block_size, conf.max_concurrency + 4)
    runner = ModelRunner(model, pools)
    block_pool, slots = BlockPool(blocks, block_size), SlotPool(conf.max_concurrency, 4)
    cache = PrefixCache(block_pool, chunk, hybrid=model.info.hybrid, slots=slots, copy_state=pools.copy_state)
    sched = Scheduler(conf, runner, block_pool, slots, cache)
    if drafter is not None and wrap is not None:
        drafter = wrap(drafter, sched)
    if drafter is not None:
        sched.speculative = BlockDraftDecoder(runner, drafter, depth, schedule)
    out: dict[str, list[int]] = {}

    def sink(s: Sequence, ev: SeqEvent) -> None:
        assert ev.error is None, ev.error
        out.setdefault(s.request_id, []).extend(ev.tokens)

    vocab = model.info.vocab_size
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n)
        sched.submit([Sequence(f"r{i}", 0, prompt, params, ChoiceSampler(params, vocab, prompt), sink)])
    for _ in range(600):
        if not sched.has_work:
            break
        sched.tick()
    assert not sched.has_work, "scheduler did not drain"
    model.keep_hidden = False
    return out, sched


def drafts_batched_and_alone(
    model: Model,
    drafter: BlockDrafter,
    prompts: Seq[list[int]],
    anchors: Seq[int],
    *,
    blocks: int,
    block_size: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The drafter's ``(drafts, confidence)`` for every prompt's block in one call (each prompt's context
    prefilled, ``anchors[i]`` fed at its end), and for each prompt's block alone (one call a prompt)."""
    draft_pools, tables, _ = prefill_features(
        model, drafter, prompts, blocks=blocks, block_size=block_size, spare=8
    )
    works = [SeqWork(i, tables[i], len(p), [anchors[i]]) for i, p in enumerate(prompts)]
    together = drafter.draft(build_batch(works, draft_pools))
    alone = [drafter.draft(build_batch([work], draft_pools)) for work in works]
    return together, alone
