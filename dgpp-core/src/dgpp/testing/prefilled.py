"""A model's cache pools prefilled with random prompts, one sequence each: the starting point of decode-step tests
(graph capture against eager, host reads, launch counts), and the pools' live tensors saved and put back."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.step.cache_spec import CacheSpec
from dgpp.step.model import Model
from dgpp.step.pools import CachePools

Saved = list[tuple[torch.Tensor, torch.Tensor]]


def prefill_random(
    model: Model,
    prompt_lens: Sequence[int],
    blocks_per_seq: int,
    block_size: int,
    *,
    seed: int,
    spec: dict[str, CacheSpec] | None = None,
    device: str = "cpu",
    first_token: int = 0,
    spare_blocks: int = 1,
    spare_seqs: int = 1,
) -> tuple[CachePools, list[list[int]], list[int], ModelRunner]:
    """(pools, block tables, each sequence's greedy next token, runner) after one prefill step of random prompts of
    ``prompt_lens`` tokens (ids from ``first_token`` up); sequence ``i`` owns blocks ``i * blocks_per_seq ..``,
    and the pools hold ``spare_blocks`` blocks and ``spare_seqs`` sequence slots more than the prompts take."""
    count = len(prompt_lens)
    pools = CachePools(
        spec if spec is not None else model.cache_spec(),
        count * blocks_per_seq + spare_blocks,
        block_size,
        count + spare_seqs,
        device,
    )
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(count)]
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(first_token, model.info.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens
    ]
    runner = ModelRunner(model, pools)
    logits = runner.step([SeqWork(i, tables[i], 0, p) for i, p in enumerate(prompts)])
    return pools, tables, torch.argmax(logits, -1).tolist(), runner


def snapshot(pools: CachePools) -> Saved:
    """Every live state and K/V tensor of ``pools`` with a copy of its contents (``restore`` puts them back)."""
    live = [t for ts in pools.state.values() for t in ts.values()]
    live += [t for ts in pools.kv.values() for t in ts if isinstance(t, torch.Tensor)]
    return [(t, t.clone()) for t in live]


def restore(saved: Saved) -> None:
    for live, copy in saved:
        live.copy_(copy)
