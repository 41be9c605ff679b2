"""QSA on Triton devices, every query row as its own decode row: a decode step's rows as they are, the rows of a
prompt chunk or a speculative verify each with its sequence's table and its own length (``expand_rows``), so a
position's output does not depend on how its sequence was chunked, verified or batched.

A decode-only step reads no host value that changes from step to step (what a CUDA graph replays): lengths come
from ``seq_lens``, shapes from the batch size and the block table's width. Per row at position ``p`` (``n = p + 1``
visible tokens):

- scores of its ``n // compress_ratio`` complete blocks, ``Σ_h relu(q_h · c) / √head_dim``, from the block keys
  the indexer stored when each block completed (``QSAIndexer.store_block_keys``; ``dgpp.kernels.dsa_index``'s
  kernel reads that entry as a paged cache of one key per slot, with one weight per head);
- its ``block_topk`` best blocks, exact ties to the lower block (``dgpp.kernels.top_k_rows``: the stable
  descending sort's picks of ``QSAIndexer._select``), expanded to their tokens plus the open block's tail, or
  all ``n`` tokens while ``n <= dense_limit()`` (``dgpp.kernels.pooled_selection``);
- attention over exactly those tokens of the paged K/V, one list per row (``dgpp.kernels.paged_attention``
  with ``positions``), cut into the policy's fixed splits, so a row's bits do not depend on the rows beside it.

When the table is too narrow for any row to see more than ``block_topk`` complete blocks every row is dense,
decided from the width alone.
"""

from __future__ import annotations

import math

import torch

from dgpp.kernels._triton import use_triton
from dgpp.kernels.dsa_index import index_scores_triton
from dgpp.kernels.pooled_selection import pooled_positions_triton
from dgpp.kernels.top_k_rows import top_k_rows_triton
from dgpp.nn.compressed_decode import entry_table
from dgpp.nn.exact.attention import expand_rows, paged_decode_attention_fixed, rows_per_call
from dgpp.plugin_api import ForwardBatch
from dgpp_qwen.layers.indexer import QSAIndexer

# fp32 block scores held at once (256 MB): rows per call = this / the table's width
_SCORES_PER_CALL = 1 << 26


def takes_row_path(x: torch.Tensor) -> bool:
    """Whether QSA runs here: Triton devices (``DGPP_KERNELS=torch`` keeps the masked torch form)."""
    return use_triton(x)


def decode_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block tables [R, W], seq_lens [R])`` of every query row as a decode row, once a step: a decode-only
    step's own tensors, else each row's sequence table and ``context + j + 1`` (from host lists)."""

    def expanded() -> tuple[torch.Tensor, torch.Tensor]:
        if batch.is_decode_only:
            return batch.block_tables, batch.seq_lens
        _, tables, lens = expand_rows(batch.block_tables, batch.seq_lens_cpu, batch.q_lens_cpu)
        return tables, lens

    return batch.step_memo("qsa_decode_rows", expanded)


def block_scores(
    indexer: QSAIndexer, q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """``[R, entries]`` fp32 scores of each row's complete blocks (``-inf`` past them)."""
    cfg = indexer.cfg
    complete = lens // cfg.compress_ratio  # padding rows (length 0) score nothing
    ones = torch.ones(q.shape[0], cfg.n_heads, dtype=torch.float32, device=q.device)
    summed = index_scores_triton(q, ones, pool, table, complete, 1.0)  # Σ_h relu(q_h · c)
    return summed / math.sqrt(cfg.head_dim)  # the reference's rounding: the head sum, then the division


def row_selection(
    indexer: QSAIndexer, q: torch.Tensor, batch: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(positions [R, block_topk·ratio + ratio - 1] int32, counts [R] int32)``: each row's attended tokens, in
    ascending order; None when the table's width keeps every row dense."""
    cfg = indexer.cfg
    ratio, topk = cfg.compress_ratio, cfg.block_topk
    tables, lens = decode_rows(batch)
    pool = batch.cache.kv[indexer.blocks_cache_name][0]
    table = entry_table(tables, ratio, batch.cache.block_size).contiguous()
    width = table.shape[1] * pool.shape[1]
    if width <= topk:
        return None
    q = q.contiguous()
    step = max(1, _SCORES_PER_CALL // width)
    parts = []
    for r in range(0, q.shape[0], step):  # one pass for a decode step; long prompts in slices of rows
        rows = slice(r, r + step)
        scores = block_scores(indexer, q[rows], pool, table[rows], lens[rows])
        picks = top_k_rows_triton(scores, lens[rows] // ratio, topk)[0]
        parts.append(pooled_positions_triton(picks, lens[rows], ratio, tail=True)[:2])
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p for p, _ in parts]), torch.cat([c for _, c in parts])


def row_attention(
    indexer: QSAIndexer,
    q: torch.Tensor,
    index_q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """``[T, Hq, Dv]``: each row's attention over its selected tokens (``q`` normed and rotated, this step's K/V
    already in ``kv``)."""
    tables, lens = decode_rows(batch)
    selection = row_selection(indexer, index_q, batch)
    positions, counts = (None, lens) if selection is None else selection

    def rows(a: int, b: int) -> torch.Tensor:
        listed = None if positions is None else positions[a:b]
        return paged_decode_attention_fixed(q[a:b], *kv, tables[a:b], counts[a:b], scale, positions=listed)

    per_call = rows_per_call(q.shape[1], kv[1].shape[-1])  # a long prompt's rows in calls (the same bits)
    if q.shape[0] <= per_call:
        return rows(0, q.shape[0])
    return torch.cat([rows(r, r + per_call) for r in range(0, q.shape[0], per_call)])
