"""Decode steps of compressed attention, batched over rows and free of host syncs (CUDA-graph safe).

The per-row reference (``dgpp.nn.compressed_attention``, ``dgpp.nn.window_compressor``) loops over sequences on
the host; a decode step (one row per sequence) here runs a few batched ops instead. The compressor pools the
window a row closes and buffers the row in its ring (``dgpp.kernels.window_pool``), then norms and rotates the
pooled rows and stores those that close a window (``(p + 1) % r == 0``) with a masked store. The indexer scores
every complete entry of each row (``dgpp.kernels.dsa_index``'s kernel on Triton devices, reading the entry pool
as a paged cache of one entry per slot) and keeps its ``topk``, ties to the lower entry (``dgpp.kernels.top_k_rows``
on Triton devices, reading each row's own entries only; ``select_top_k`` elsewhere).
The attention is one softmax per row over window, entries and sink (``dgpp.kernels.compressed_decode_attention``:
one fused kernel on Triton devices, a padded torch form elsewhere). Padded graph rows (state slot -1,
``seq_len`` 0) read clamped indices and write nothing. ``tests/perf/check_deepseek_v4_cuda.py`` checks these
against the reference at release sizes.
"""

from __future__ import annotations

import torch

from dgpp.kernels.compressed_decode_attention import (
    CompressedDecodeInputs,
    compressed_decode_attention_ref,
    compressed_decode_attention_triton,
    entry_rows,
)
from dgpp.kernels.dsa_index import index_scores_triton, select_top_k
from dgpp.kernels.masked_rows import store_rows
from dgpp.kernels.top_k_rows import top_k_rows_triton
from dgpp.kernels.window_pool import (
    EntryFinish,
    WindowPoolInputs,
    window_compress_decode_triton,
    window_pool_decode_ref,
)
from dgpp.nn.dsa import index_scores_rows
from dgpp.step.batch import ForwardBatch


def _live(batch: ForwardBatch) -> torch.Tensor:
    return (batch.state_slots >= 0) & (batch.seq_lens > 0)


def entry_table(block_tables: torch.Tensor, ratio: int, block_size: int) -> torch.Tensor:
    """The table through which entry ``e`` is ``pool[table[e // per_block], e % per_block]`` (``per_block =
    pool.shape[1]``): entry ``e`` sits in the block of its window's last position ``(e + 1)·r - 1``, so the
    block table itself when ``r`` divides the block size, else every ``r / block_size``-th column of it."""
    if ratio <= block_size:
        return block_tables
    step = ratio // block_size
    return block_tables[:, step - 1 :: step]


def compress_decode(comp, x: torch.Tensor, batch: ForwardBatch, fused: bool) -> None:
    """``WindowCompressor.forward`` for a decode step (one row per sequence)."""
    ring = batch.cache.state[comp.buffer_name]
    pool = batch.cache.kv[comp.cache_name][0]
    pos, r = batch.positions, comp.ratio
    step = WindowPoolInputs(
        comp.wkv(x),
        comp.wgate(x),
        ring["kv"],
        ring["gate"],
        comp.ape,
        batch.state_slots,
        pos,
        batch.seq_lens,
        r,
        comp.overlap,
    )
    if fused:
        rotary = comp.rotary
        finish = EntryFinish(
            comp.norm.weight,
            comp.norm.eps,
            rotary.inv_freq,
            rotary.magnitude,
            rotary.fp32_angles,
            rotary.rotary_dim,
            pool,
            batch.block_tables,
            batch.cache.block_size,
        )
        window_compress_decode_triton(step, finish)
        return
    pooled = window_pool_decode_ref(step)
    window = pos // r
    pooled = comp.finish(pooled, window)
    last = (window + 1) * r - 1
    column = (last // batch.cache.block_size).clamp(max=batch.block_tables.shape[1] - 1)[:, None]
    block = batch.block_tables.gather(1, column)[:, 0].long().clamp(min=0)  # one column, not the whole table
    rows = block * pool.shape[1] + (last % batch.cache.block_size) // r
    store_rows(pool.view(-1, pool.shape[-1]), rows, pooled, _live(batch) & ((pos + 1) % r == 0))


def indexer_decode(
    indexer, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch, fused: bool
) -> torch.Tensor:
    """The indexer's picks ``[B, min(topk, E)]`` for a decode step: each row's best complete entries first (ties
    to the lower entry); a row with fewer complete entries than ``topk`` picks them all, then padding."""
    compress_decode(indexer.compressor, x, batch, fused)
    rows = x.shape[0]
    q = indexer.rotary.rotate(
        indexer.wq_b(q_resid).view(rows, indexer.num_heads, indexer.head_dim), batch.positions
    )
    weights, weight_scale = indexer.weights_proj(x), indexer.num_heads**-0.5
    pool = batch.cache.kv[indexer.compressor.cache_name][0]
    table = entry_table(batch.block_tables, indexer.ratio, batch.cache.block_size).contiguous()
    ratio = indexer.ratio  # every CSA layer of the step counts the same complete entries: once a step
    complete = batch.step_memo(
        ("complete_entries", ratio), lambda: torch.where(_live(batch), (batch.positions + 1) // ratio, 0)
    )
    scale = indexer.head_dim**-0.5
    if fused:  # the top-k reads each row's own complete entries, not the table's width
        scores = index_scores_triton(q, weights, pool, table, complete, scale, weight_scale=weight_scale)
        return top_k_rows_triton(scores, complete, indexer.topk)[0]
    weights = weights.float() * weight_scale
    entry = torch.arange(table.shape[1] * pool.shape[1], device=x.device)
    keys = entry_rows(pool, table, entry[None].expand(rows, -1)).float()
    scores = index_scores_rows(q.float(), keys, weights)
    return select_top_k(scores, complete, indexer.topk)[0]


def compressed_attention_decode(
    core,
    q: torch.Tensor,
    kv: torch.Tensor,
    x: torch.Tensor,
    q_resid: torch.Tensor,
    batch: ForwardBatch,
    sinks: torch.Tensor,
    fused: bool,
) -> torch.Tensor:
    """``CompressedSinkAttention`` of a compressed layer for a decode step (the ring write is the caller's);
    ``fused``: the Triton kernels, else their torch forms."""
    ratio = core.compressor.ratio
    compress_decode(core.compressor, x, batch, fused)
    picks = indexer_decode(core.indexer, x, q_resid, batch, fused) if core.indexer is not None else None
    attend = compressed_decode_attention_triton if fused else compressed_decode_attention_ref
    return attend(
        CompressedDecodeInputs(
            q,
            kv,
            batch.cache.state[core.cache_name]["k"],
            batch.cache.kv[core.compressor.cache_name][0],
            entry_table(batch.block_tables, ratio, batch.cache.block_size),
            batch.state_slots,
            batch.positions,
            batch.seq_lens,
            sinks,
            core.scale,
            ratio,
            picks,
        )
    )
