"""Block drafter (``dgpp.engine.block_draft``) tests of any family: the drafter's context filled from the target's
prefill (``prefill_features``), and greedy serving through the scheduler with the drafter or without
(``serve_greedy``), whose transcripts are compared with a plain run's."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

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
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import CacheSpec
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
    oracle: tuple[dict[str, list[int]], int] | None = None,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Serves every prompt greedily (request ``r{i}`` for ``prompts[i]``, ``max_tokens[i]`` tokens) on a fresh
    scheduler over ``blocks`` cache blocks of ``block_size``, verifying ``drafter``'s blocks ``depth`` drafts deep
    when given. ``oracle`` (transcripts by request, ``right``): the drafter's blocks are replaced by
    ``OracleBlocks`` over those transcripts. Returns each request's tokens and the drained scheduler (its
    counters); fails on an errored request or one left unfinished after 600 ticks."""
    conf = scheduler_config(
        block_size=block_size, chunk_tokens=chunk, max_concurrency=concurrency, queue_limit=4096
    )
    pools = CachePools(model.cache_spec(), blocks, block_size, conf.max_concurrency + 4)
    runner = ModelRunner(model, pools)
    block_pool, slots = BlockPool(blocks, block_size), SlotPool(conf.max_concurrency, 4)
    cache = PrefixCache(block_pool, chunk, hybrid=model.info.hybrid, slots=slots, copy_state=pools.copy_state)
    sched = Scheduler(conf, runner, block_pool, slots, cache)
    if drafter is not None and oracle is not None:
        transcripts, right = oracle
        full = {f"r{i}": list(p) + transcripts[f"r{i}"] for i, p in enumerate(prompts)}
        drafter = OracleBlocks(drafter, sched, full, right, model.info.vocab_size)
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


class OracleBlocks:
    """A block drafter (its context written, its block run) whose blocks are replaced: each block's first ``right``
    drafts by the tokens ``full[request]`` holds there (the expected transcript after the prompt), the rest by a
    wrong token, so blocks stand exactly ``right`` drafts deep and then break."""

    def __init__(
        self, drafter: BlockDrafter, sched: Scheduler, full: dict[str, list[int]], right: int, vocab: int
    ) -> None:
        self.drafter, self.sched, self.full, self.right, self.vocab = drafter, sched, full, right, vocab
        self.drafts = drafter.drafts

    def cache_spec(self) -> dict[str, CacheSpec]:
        return self.drafter.cache_spec()

    def absorb(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        self.drafter.absorb(batch, features)

    def draft(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, confidence = self.drafter.draft(batch)
        by_slot = {s.slot: s for s in self.sched.live}
        for i, slot in enumerate(batch.state_slots.tolist()):
            full, c = self.full[by_slot[slot].request_id], batch.context_lens_cpu[i]
            for j in range(self.drafts):
                token = full[c + 1 + j] if c + 1 + j < len(full) else 0
                tokens[i, j] = token if j < self.right else (token + 1) % self.vocab
        return tokens, confidence


class BlockReader(BlockDrafter, Protocol):
    """A block drafter that also shows a block's base logits and collapsed rows (the DSpark drafters)."""

    def block_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def check_blocks(
    model: Model,
    drafter: BlockReader,
    prompts: Seq[list[int]],
    anchors: Seq[int],
    reference: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]],
    *,
    blocks: int,
    block_size: int,
) -> None:
    """Each prompt prefilled and written into the drafter's context, then one drafter call drafting a block after
    each (fed ``anchors[i]``) against ``reference(features, context length, anchor)``'s ``(base logits,
    collapsed rows, drafts, confidences)``: logits, rows and confidences within 1e-4, the drafts equal and not
    one repeated token. A block at the first prompt's place with a context 3 rows older drafts other logits."""
    draft_pools, tables, features = prefill_features(
        model, drafter, prompts, blocks=blocks, block_size=block_size, spare=drafter.drafts + 1
    )
    works = [SeqWork(i, tables[i], len(p), [anchors[i]]) for i, p in enumerate(prompts)]
    base, collapsed, _ = drafter.block_logits(build_batch(works, draft_pools))
    drafts, confidence = drafter.draft(build_batch(works, draft_pools))
    for i, prompt in enumerate(prompts):
        r_base, r_collapsed, r_drafts, r_conf = reference(features[i], len(prompt), anchors[i])
        assert (base[i].double() - r_base).abs().max() < 1e-4
        assert (collapsed[i].double() - r_collapsed).abs().max() < 1e-4
        assert drafts[i].tolist() == r_drafts
        assert len(set(r_drafts)) > 1  # the drafts follow the logits, not one repeated token
        assert (confidence[i].double() - r_conf).abs().max() < 1e-4
    stale = build_batch([SeqWork(0, tables[0], len(prompts[0]) - 3, [anchors[0]])], draft_pools)
    assert (drafter.block_logits(stale)[0][0] - base[0]).abs().max() > 1e-2


def check_exact_with_drafts(
    out: dict[str, list[int]], plain: dict[str, list[int]], sched: Scheduler, right: int | None = None
) -> None:
    """``out`` (served with a drafter) is the plain transcript; some drafts stood and some were cut, or with
    ``right`` (``OracleBlocks``) every block stood exactly ``right`` deep."""
    assert out == plain
    stats = sched.speculative.stats
    if right is None:
        assert stats.num_draft_tokens_total > 0 and stats.num_accepted_tokens_total > 0  # some blocks stand
        assert stats.num_accepted_tokens_total < stats.num_draft_tokens_total  # and some are cut
    else:
        per_pos = stats.accepted_tokens_per_pos
        assert all(n > 0 for n in per_pos[:right]) and all(n == 0 for n in per_pos[right:])


def check_drafted_together_equals_alone(
    model: Model,
    drafter: BlockDrafter,
    prompts: Seq[list[int]],
    anchors: Seq[int],
    *,
    blocks: int,
    block_size: int,
) -> None:
    """Every prompt's block drafted in one call (each prompt's context prefilled, ``anchors[i]`` fed at its end)
    has the drafts of its block drafted alone, and confidences within 1e-6: the drafter's batched attention
    keeps each request to its own context."""
    draft_pools, tables, _ = prefill_features(
        model, drafter, prompts, blocks=blocks, block_size=block_size, spare=8
    )
    works = [SeqWork(i, tables[i], len(p), [anchors[i]]) for i, p in enumerate(prompts)]
    drafts, confidence = drafter.draft(build_batch(works, draft_pools))
    for i, work in enumerate(works):
        alone_drafts, alone_confidence = drafter.draft(build_batch([work], draft_pools))
        assert torch.equal(drafts[i], alone_drafts[0]), i
        assert float((confidence[i] - alone_confidence[0]).abs().max()) < 1e-6, i
