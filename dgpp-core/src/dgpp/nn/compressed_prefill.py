"""Prefill / extend steps of compressed attention (DeepSeek-V4's CSA and HCA layers), batched over a chunk's rows.

The same math as the per-row reference (``dgpp.nn.compressed_attention``), in a few ops per step:

1. the compressors pool every window the step completes, per sequence in one batched call
   (``WindowPooler.store``);
2. the lightning indexer scores every row against its sequence's complete index entries at once and keeps
   each row's ``topk`` (a row at ``p`` sees entry ``w`` once ``(w + 1)·r <= p + 1``; exact ties to the lower
   entry; a row with at most ``topk`` complete entries keeps them all). On CUDA the scores come from
   ``dgpp.kernels.dsa_index`` (each (row, entry) score from that row and entry alone) and the selection from
   its ``select_top_k``; elsewhere rows with the same number of visible entries are scored as one batch of
   per-row products and keep their best by a stable sort, as the reference does row by row;
3. one attention call (``dgpp.kernels.compressed_attention``) over each row's window, its entries (the picks
   on CSA, every complete one on HCA) and the sinks.

Every row's result depends on its position and its sequence's cache alone, so chunked prefill, batching and
prefix-cache restores keep the reference's property: the same bits however the prompt was cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dgpp.kernels._triton import use_triton
from dgpp.kernels.compressed_attention import compressed_attention, per_row_bmm
from dgpp.kernels.dsa_index import index_scores_triton, select_top_k
from dgpp.kernels.window_attention import row_sequences
from dgpp.nn.window_compressor import entry_slots, live_sequences
from dgpp.step.batch import ForwardBatch

if TYPE_CHECKING:
    from dgpp.nn.compressed_attention import CompressedSinkAttention, LightningIndexer


def entry_table(pool: torch.Tensor, batch: ForwardBatch, ratio: int) -> torch.Tensor:
    """Flat pool rows of every sequence's complete entries after this step ``[B, E]`` (0 past a sequence's)."""
    counts = [end // ratio for end in batch.seq_lens_cpu]
    table = torch.zeros(len(counts), max([0, *counts]), dtype=torch.long, device=pool.device)
    for seq in live_sequences(batch):
        n = counts[seq.index]
        if n:
            entries = torch.arange(n, device=pool.device)
            table[seq.index, :n] = entry_slots(
                batch.block_tables[seq.index], entries, ratio, batch.cache.block_size, pool.shape[1]
            )
    return table


def _best_by_rows(
    indexer: LightningIndexer,
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    batch: ForwardBatch,
    table: torch.Tensor,
    picks: torch.Tensor,
) -> None:
    """The torch form of the selection: rows of one sequence seeing the same ``v > topk`` entries are scored as
    one batch of per-row products ``Σ_h w_h · relu(q_h · k) · D^-½`` and keep the ``topk`` best (stable sort:
    ties to the lower entry), ascending, written into ``picks``."""
    r, topk = indexer.ratio, indexer.topk
    for b, start, _, ctx, end, _ in live_sequences(batch):
        seq_keys = keys[table[b, : end // r]].float()
        for v in range(max(topk + 1, (ctx + 1) // r), end // r + 1):
            lo, hi = max(ctx, v * r - 1), min(end, (v + 1) * r - 1)  # positions p with (p + 1) // r == v
            rows = slice(start + lo - ctx, start + hi - ctx)
            n = hi - lo
            transposed = seq_keys[:v].t().expand(n, -1, -1)
            per_head = F.relu(per_row_bmm(q[rows].float(), transposed)) * indexer.head_dim**-0.5  # [n, H, v]
            scores = (per_head * weights[rows][:, :, None]).sum(dim=1)
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
            picks[rows] = order.sort(dim=1).values


def index_picks(
    indexer: LightningIndexer, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool the step's index entries, then every row's picks: ``(entries [T, K], count [T])``, ascending, the
    first ``count`` of each row real."""
    indexer.compressor(x, batch)
    rows, r, topk = x.shape[0], indexer.ratio, indexer.topk
    visible = (batch.positions + 1) // r
    if max([0, *(end // r for end in batch.seq_lens_cpu)]) <= topk:
        # no row sees more entries than it keeps: each takes every complete one
        width = max([0, *(end // r for end in batch.seq_lens_cpu)])
        return torch.arange(width, device=x.device).expand(rows, width), visible
    q = indexer.rotary.rotate(
        indexer.wq_b(q_resid).view(rows, indexer.num_heads, indexer.head_dim), batch.positions
    )
    weights = indexer.weights_proj(x).float() * indexer.num_heads**-0.5
    pool = batch.cache.kv[indexer.compressor.cache_name][0]
    table = entry_table(pool, batch, r)
    keys = pool.view(-1, pool.shape[-1])
    if use_triton(q):
        row_tables = table[row_sequences(batch.query_start_loc, rows)].to(torch.int32)
        scores = index_scores_triton(
            q, weights, keys[:, None, None, :], row_tables, visible.to(torch.int32), indexer.head_dim**-0.5
        )
        picks, count = select_top_k(scores, visible, topk)
        return picks.long(), count.long()
    picks = torch.arange(topk, device=x.device).repeat(rows, 1)
    _best_by_rows(indexer, q, weights, keys, batch, table, picks)
    return picks, visible.clamp(max=topk)


def compressed_attention_prefill(
    core: CompressedSinkAttention,
    q: torch.Tensor,
    kv: torch.Tensor,
    x: torch.Tensor,
    q_resid: torch.Tensor,
    batch: ForwardBatch,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``CompressedSinkAttention`` of a compressed layer for any step (the ring write is the caller's)."""
    compressor = core.compressor
    assert compressor is not None
    compressor(x, batch)  # this step's complete windows first: its later rows may attend them
    pool = batch.cache.kv[compressor.cache_name][0]
    table = entry_table(pool, batch, compressor.ratio)
    row_tables = table[row_sequences(batch.query_start_loc, q.shape[0])]
    if core.indexer is not None:
        picks, count = index_picks(core.indexer, x, q_resid, batch)
        entry_rows = row_tables.gather(1, picks.clamp(max=max(0, table.shape[1] - 1)))
    else:
        entry_rows, count = row_tables, (batch.positions + 1) // compressor.ratio
    ring = batch.cache.state[core.cache_name]["k"]
    return compressed_attention(
        q,
        kv,
        ring,
        pool,
        entry_rows,
        count,
        batch.query_start_loc,
        batch.context_lens,
        batch.seq_lens,
        batch.state_slots,
        sinks,
        core.scale,
        core.window,
    )
