"""A model run offline, straight through the ``ModelRunner`` without a scheduler: greedy generation and every
row's logits of whole prompts. Tests compare the scheduler, the server and other families' references with it;
``dgpp bench kv-quality`` scores a chain with it (serving is ``dgpp.sched``'s).

All sequences advance together: each step carries, per unfinished sequence, its next prefill chunk
(``chunk_size`` tokens, or the whole prompt) or its one decode token, so steps mix prefill and decode
whenever prompts differ in length. Ties go to the lowest token id (``torch.argmax``'s first maximum).
"""

from __future__ import annotations

from collections import deque

import torch

from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.work import SeqWork
from dgpp.media.prompt import PromptMedia
from dgpp.sched.block_pool import BlockPool
from dgpp.step.cache_spec import stored_as
from dgpp.step.model import Model
from dgpp.step.pools import CachePools


class OutOfSlots(RuntimeError):
    """Every state slot is in use."""


class SlotAllocator:
    """State-pool slot ids ``0..num_slots-1``, each held by at most one live sequence (misuse raises)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._used: set[int] = set()

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are in use")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)


def make_pools(
    model: Model, total_tokens: list[int], block_size: int, kv_dtype: str = "auto"
) -> tuple[CachePools, BlockPool, SlotAllocator]:
    """Pools just large enough for sequences of ``total_tokens`` tokens each, K/V stored as ``kv_dtype``
    (``engine.kv_dtype``) says; the scheduler's ``BlockPool`` hands out their blocks."""
    num_blocks = sum(-(-n // block_size) for n in total_tokens)
    device = next(model.parameters()).device
    spec = stored_as(model.cache_spec(), kv_dtype)
    pools = CachePools(spec, num_blocks, block_size, len(total_tokens), device=device)
    return pools, BlockPool(num_blocks, block_size), SlotAllocator(len(total_tokens))


def greedy_generate(
    model: Model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    block_size: int = 16,
    stop_at_eos: bool = True,
    media: list[PromptMedia | None] | None = None,
    kv_dtype: str = "auto",
) -> list[list[int]]:
    """The greedy continuation (new tokens only) of each prompt; a sequence stops after an EOS id. ``media``: per
    prompt, its images (``dgpp.media.prompt.PromptMedia``) or None; ``kv_dtype``: the K/V format
    (``engine.kv_dtype``)."""
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > model.info.max_position:
        raise ValueError(
            f"prompt + max_new_tokens = {longest} exceeds the model's {model.info.max_position} positions"
        )
    pools, blocks, slots = make_pools(model, [len(p) + max_new_tokens for p in prompts], block_size, kv_dtype)
    runner = ModelRunner(model, pools)
    eos = set(model.info.eos_token_ids) if stop_at_eos else set()
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    tables = [blocks.allocate(blocks.blocks_for_tokens(len(p) + max_new_tokens)) for p in prompts]
    state_slots = [slots.allocate() for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    live = [i for i in range(len(prompts)) if max_new_tokens > 0]
    while live:
        work = []
        for i in live:
            feed = tokens[i][cached[i] :]
            if chunk_size:
                feed = feed[:chunk_size]
            last = cached[i] + len(feed) == len(tokens[i])
            work.append(
                SeqWork(state_slots[i], tables[i], cached[i], feed, last, media=media[i] if media else None)
            )
        logits = runner.step(work)
        row = 0
        for i, w in zip(live, work, strict=True):
            cached[i] += len(w.token_ids)
            if not w.want_logits:
                continue
            token = int(torch.argmax(logits[row]))
            row += 1
            tokens[i].append(token)
            out[i].append(token)
        live = [i for i in live if not (len(out[i]) >= max_new_tokens or (out[i] and out[i][-1] in eos))]
    for table, slot in zip(tables, state_slots, strict=True):
        for block in table:
            blocks.decref(block)
        slots.free(slot)
    return out


DEFAULT_LENGTHS = (5, 12, 23, 9)  # prompt lengths of the conformance checks: short, past a block, odd


def make_prompts(
    vocab_size: int, lengths: tuple[int, ...] = DEFAULT_LENGTHS, seed: int = 0
) -> list[list[int]]:
    """Random prompts of the given lengths (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.inference_mode()
def engine_all_logits(
    model: Model,
    prompts: list[list[int]],
    block_size: int = 16,
    chunk_size: int | None = None,
    kv_dtype: str = "auto",
) -> list[torch.Tensor]:
    """Logits of every row of every prompt (fp32), all prompts prefilled together: in one step, or
    in steps of ``chunk_size`` tokens per prompt; K/V stored as ``kv_dtype`` (``engine.kv_dtype``) says."""
    pools, blocks, slots = make_pools(model, [len(p) for p in prompts], block_size, kv_dtype)
    seqs = [(slots.allocate(), blocks.allocate(blocks.blocks_for_tokens(len(p)))) for p in prompts]
    if model.info.hybrid:
        for slot, _ in seqs:
            pools.zero_state(slot)
    device = next(model.parameters()).device
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        work = [
            SeqWork(*seqs[i], done[i], prompts[i][done[i] : done[i] + (chunk_size or len(prompts[i]))])
            for i in live
        ]
        batch = build_batch(work, pools, device)
        batch.logits_indices = torch.arange(batch.num_tokens, device=batch.input_ids.device)
        logits = model.compute_logits(model(batch)).float()
        for i, w, part in zip(live, work, logits.split([len(w.token_ids) for w in work]), strict=True):
            rows[i].append(part)
            done[i] += len(w.token_ids)
    return [torch.cat(r) for r in rows]
