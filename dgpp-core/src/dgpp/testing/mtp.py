"""Helpers for testing MTP drafters (``dgpp_build_draft``) of any family against a reference."""

from __future__ import annotations

import torch

from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.offline import make_pools


@torch.inference_mode()
def draft_logits(model, drafter, tokens: list[int], chunks: list[int], block_size: int = 16) -> torch.Tensor:
    """The main model over ``tokens[:-1]`` (its ``last_hidden`` keeps every row), then the drafter over
    (hidden at ``p``, token ``p + 1``) for every position, prefilled in ``chunks`` (summing to
    ``len(tokens) - 1``); the drafter's fp32 logits of every row, in position order."""
    n = len(tokens) - 1
    if sum(chunks) != n:
        raise ValueError(f"chunks {chunks} do not cover the {n} drafted positions")
    pools, blocks, slots = make_pools(model, [n], block_size)
    slot = slots.allocate()
    pools.zero_state(slot)
    keep, model.keep_hidden = model.keep_hidden, True
    try:
        device = next(model.parameters()).device  # build_batch builds on the host unless told
        model(
            build_batch(
                [SeqWork(slot, blocks.allocate(blocks.blocks_for_tokens(n)), 0, tokens[:n])], pools, device
            )
        )
        hidden = model.last_hidden
    finally:
        model.keep_hidden = keep
    draft_pools, draft_blocks, draft_slots = make_pools(drafter, [n], block_size)
    table, draft_slot = draft_blocks.allocate(draft_blocks.blocks_for_tokens(n)), draft_slots.allocate()
    out, start = [], 0
    for size in chunks:
        batch = build_batch(
            [SeqWork(draft_slot, table, start, tokens[start + 1 : start + 1 + size])], draft_pools, device
        )
        batch.logits_indices = torch.arange(size, device=batch.input_ids.device)
        out.append(drafter.compute_logits(drafter(batch, hidden[start : start + size], 0), 0).float())
        start += size
    return torch.cat(out)
