"""Prefill / extend steps of compressed attention (DeepSeek-V4's CSA and HCA layers), batched over a chunk's rows.

The same math as the per-row reference (``dgpp.nn.compressed_attention``), in a few ops per step:

1. the compressors pool every window the step completes, per sequence in one batched call
   (``WindowPooler.store``);
2. the lightning indexer scores every row against its sequence's complete index entries at once and keeps
   each row's ``topk`` (a row at ``p`` sees entry ``w`` once ``(w + 1)·r <= p + 1``; exact ties to the lower
   entry; a row with at most ``topk`` complete entries keeps them all). On CUDA the scores come from
   ``dgpp.kernels.dsa_index`` (each (row, entry) score from that row and entry alone) and the selection from a
   per-row radix select over the row's own entries (``dgpp.kernels.top_k_rows``: ``select_top_k``'s picks);
   elsewhere rows with the same number of visible entries are scored as one batch of
   per-row products and keep their best by a stable sort, as the reference does row by row;
3. the inputs of one attention call (``dgpp.kernels.compressed_attention``): each row's window, its entries
   (the picks on CSA, every complete one on HCA) and the sinks.

Every row's result depends on its position and its sequence's cache alone, so chunked prefill, batching and
prefix-cache restores keep the reference's property: the same bits however the prompt was cut.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import use_triton
from dgpp.kernels.compressed_attention import CompressedAttentionInputs
from dgpp.kernels.dsa_index import index_scores_triton
from dgpp.kernels.top_k_rows import top_k_rows_triton
from dgpp.kernels.window_attention import row_sequences
from dgpp.nn.dsa import index_scores_rows
from dgpp.nn.window_compressor import entry_slots, live_sequences
from dgpp.step.batch import ForwardBatch

Picks = tuple[torch.Tensor, torch.Tensor]  # per row: entries [T, K] ascending, how many of them are real [T]


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
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    batch: ForwardBatch,
    table: torch.Tensor,
    ratio: int,
    picks: torch.Tensor,
) -> None:
    """The torch form of the selection: rows of one sequence seeing the same ``v > topk`` entries are scored as
    one batch of per-row products ``Σ_h w_h · relu(q_h · k) · D^-½`` and keep the ``topk`` best (stable sort:
    ties to the lower entry), ascending, written into ``picks [T, topk]``."""
    r, topk = ratio, picks.shape[1]
    for b, start, _, ctx, end, _ in live_sequences(batch):
        seq_keys = keys[table[b, : end // r]].float()
        for v in range(max(topk + 1, (ctx + 1) // r), end // r + 1):
            lo, hi = max(ctx, v * r - 1), min(end, (v + 1) * r - 1)  # positions p with (p + 1) // r == v
            rows = slice(start + lo - ctx, start + hi - ctx)
            scores = index_scores_rows(q[rows].float(), seq_keys[:v].expand(hi - lo, -1, -1), weights[rows])
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
            picks[rows] = order.sort(dim=1).values


def select_entries(
    q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, batch: ForwardBatch, ratio: int, topk: int
) -> Picks:
    """Every row's ``topk`` best complete entries of the index pool (``q [T, H, D]`` rotated, ``weights [T, H]``
    fp32), or all of them where it has no more; the step's index entries already stored."""
    rows = q.shape[0]
    visible = (batch.positions + 1) // ratio
    table = entry_table(pool, batch, ratio)
    keys = pool.view(-1, pool.shape[-1])
    if use_triton(q):
        row_tables = table[row_sequences(batch.query_start_loc, rows)].to(torch.int32)
        scale = q.shape[-1] ** -0.5
        lens = visible.to(torch.int32)
        scores = index_scores_triton(q, weights, keys[:, None, None, :], row_tables, lens, scale)
        picks, count = top_k_rows_triton(scores, lens, topk)
        return picks.long(), count.long()
    picks = torch.arange(topk, device=q.device).repeat(rows, 1)
    _best_by_rows(q, weights, keys, batch, table, ratio, picks)
    return picks, visible.clamp(max=topk)


def every_entry(batch: ForwardBatch, ratio: int) -> Picks:
    """Each row's every complete entry (a step where no row sees more than it keeps)."""
    width = max([0, *(end // ratio for end in batch.seq_lens_cpu)])
    rows = batch.positions.shape[0]
    return torch.arange(width, device=batch.positions.device).expand(rows, width), (
        batch.positions + 1
    ) // ratio


def attention_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    pool: torch.Tensor,
    batch: ForwardBatch,
    sinks: torch.Tensor,
    scale: float,
    window: int,
    ratio: int,
    picks: Picks | None,
) -> CompressedAttentionInputs:
    """One compressed layer's attention inputs for any step, the step's entries already stored: each row's
    window, its ``picks`` (CSA) or every complete entry (``None``: HCA), and the sinks."""
    table = entry_table(pool, batch, ratio)
    row_tables = table[row_sequences(batch.query_start_loc, q.shape[0])]
    if picks is not None:
        entries, count = picks
        entry_rows = row_tables.gather(1, entries.clamp(max=max(0, table.shape[1] - 1)))
    else:
        entry_rows, count = row_tables, (batch.positions + 1) // ratio
    return CompressedAttentionInputs(
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
        scale,
        window,
    )
