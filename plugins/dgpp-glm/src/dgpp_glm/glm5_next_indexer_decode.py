"""The k-pooled indexer's decode step on device tensors alone: the open-pool ring write, the pool a row completes,
and every row's selection, from ``context_lens`` / ``seq_lens`` / ``block_tables`` / ``state_slots`` as the step
holds them on its device. Nothing is read back to the host and every shape follows the step's table, so the eager
step and a captured CUDA graph run the same code (padding rows, slot -1 and length 0, write nothing and select
nothing).

Masked writes without a host sync: a row that must not write repeats the first writing row's write (same place,
same value), so the duplicate indices of one ``index_copy_`` carry equal values; with no writer at all every row
rewrites one place with the value it already holds. Quantized pooled keys (``engine.kv_dtype`` fp8 / fp4) go through
``dgpp.kernels.write_quantized``: on CUDA one launch that skips a slot of -1 on the device; its torch reference (off
CUDA) selects the kept rows on the host.

On CUDA the ring and pooled-key writes are masked-store launches (``dgpp.kernels.masked_rows``) and the selection
is three launches: scores, a per-row radix top-k and the expansion to positions (``select_decode_fused``).

A row at position ``p`` sees ``n = (p + 1) // kpool`` complete pools. Its scores cover every pool the table could
hold, masked to ``-inf`` past ``n``; a stable descending sort keeps exact ties on the lower pool, as the row-by-row
path does (on CUDA the radix top-k picks the same pools). A table too narrow to hold more pools than a row keeps selects nothing (None: every row dense).
Otherwise positions are ``[rows, topk + kpool - 1]``: a sparse row's picked pools' tokens then its open tail; a
dense row (``n`` at most the pools kept) every visible token, and not marked ``sparse``, so attention reads it
densely as on the row path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dgpp.kernels._triton import use_triton
from dgpp.nn.dsa import index_scores_rows
from dgpp.nn.selection import DeviceSelection
from dgpp.nn.window_compressor import entry_rows
from dgpp.plugin_api import ForwardBatch


class PoolingIndexer(Protocol):
    """What the decode step reads of ``dgpp_glm.glm5_next_indexer.KPoolIndexer`` (named here, not imported, so
    the two modules do not import each other)."""

    @property
    def kpool(self) -> int: ...
    @property
    def select_pools(self) -> int: ...
    @property
    def select_tail(self) -> bool: ...
    @property
    def buffer_name(self) -> str: ...
    @property
    def cache_name(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype: ...

    def pool_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor: ...


def write_rows(flat: torch.Tensor, targets: torch.Tensor, values: torch.Tensor, writes: torch.Tensor) -> None:
    """``flat[targets[r]] = values[r]`` for the rows where ``writes`` (a device mask); ``targets`` in range."""
    first = writes.to(torch.int8).argmax()
    source = torch.where(writes, torch.arange(writes.shape[0], device=writes.device), first)
    where_to = targets[source]
    keep = writes[source].view(-1, *([1] * (values.dim() - 1)))
    flat.index_copy_(0, where_to, torch.where(keep, values[source].to(flat.dtype), flat[where_to]))


def pool_slots(
    tables: torch.Tensor, pools: torch.Tensor, kpool: int, block_size: int, rows_per_block: int
) -> torch.Tensor:
    """Flat cache rows of pools ``pools [B, n]`` of each row's table (a pool sits in the block of its last token),
    clamped into the table: only pools the row has completed are read or written at their true place."""
    last = (pools + 1) * kpool - 1
    column = (last // block_size).clamp(max=tables.shape[1] - 1)
    block = tables.gather(1, column).long().clamp(min=0)
    return block * rows_per_block + (last % block_size) // kpool


def store_decode(indexer: PoolingIndexer, kv: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch) -> None:
    """Buffer each decode row's key and gate logits in its ring, then pool and store the pool the row completes."""
    ring = batch.cache.state[indexer.buffer_name]
    ring_kv, ring_gate = ring["kv"], ring["gate"]
    kpool = indexer.kpool
    live = batch.state_slots >= 0
    position = batch.context_lens.long()
    slot = batch.state_slots.long().clamp(min=0)
    ring_rows = slot * kpool + position % kpool
    # on CUDA one masked-store launch per write (dgpp.kernels.masked_rows); the torch form repeats a writing row
    store: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] = write_rows
    if use_triton(kv):
        from dgpp.kernels.masked_rows import store_rows_triton

        store = store_rows_triton
    store(ring_kv.view(-1, ring_kv.shape[-1]), ring_rows, kv, live)
    store(ring_gate.view(-1, ring_gate.shape[-1]), ring_rows, gate, live)
    pooled = indexer.pool_windows(ring_kv[slot], ring_gate[slot])  # [B, D]; used where a pool completes
    completes = live & ((position + 1) % kpool == 0)
    cache = batch.cache.kv[indexer.cache_name][0]
    targets = pool_slots(
        batch.block_tables, (position // kpool)[:, None], kpool, batch.cache.block_size, cache.shape[1]
    )[:, 0]
    scales = batch.cache.kv_scales.get(indexer.cache_name)
    if scales is None:
        store(cache.view(-1, cache.shape[-1]), targets, pooled, completes)
        return
    # e4m3 index keys (engine.kv_dtype fp8 / fp4), the row path's bytes: on CUDA quantized and stored in one launch,
    # a row that completes no pool skipped (slot -1)
    from dgpp import kernels

    kernels.write_quantized(cache, scales[0], pooled[:, None], torch.where(completes, targets, -1))


def select_decode(
    indexer: PoolingIndexer, q: torch.Tensor, weights: torch.Tensor, batch: ForwardBatch
) -> DeviceSelection | None:
    """Every decode row's attended positions (``q [B, H, D]``, ``weights [B, H]`` fp32); None (every row dense, as
    the row path says for such rows) when the table is too narrow for any row to see more pools than it keeps,
    a decision from the table's width alone."""
    kpool, keep = indexer.kpool, indexer.select_pools
    cache = batch.cache.kv[indexer.cache_name][0]
    tables = batch.block_tables
    device = q.device
    capacity = tables.shape[1] * batch.cache.block_size // kpool
    if capacity <= keep:
        return None
    if use_triton(q):
        return select_decode_fused(indexer, q, weights, batch)
    scales = batch.cache.kv_scales.get(indexer.cache_name)
    visible = batch.seq_lens.long()
    complete = visible // kpool
    every_pool = torch.arange(capacity, device=device)
    slots = pool_slots(
        tables, every_pool.expand(tables.shape[0], -1), kpool, batch.cache.block_size, cache.shape[1]
    )
    keys = entry_rows(
        cache, None if scales is None else scales[0], slots, indexer.dtype
    ).float()  # [B, capacity, D]
    scores = index_scores_rows(q, keys, weights)
    scores = scores.masked_fill(every_pool[None, :] >= complete[:, None], float("-inf"))
    width = keep * kpool + kpool - 1
    columns = torch.arange(width, device=device)
    dense = columns.expand(q.shape[0], -1)
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :keep].sort(dim=1).values
    tokens = (best[:, :, None] * kpool + torch.arange(kpool, device=device)).flatten(1)
    open_tail = visible % kpool if indexer.select_tail else torch.zeros_like(visible)
    tail = (visible - visible % kpool)[:, None] + columns[None, : kpool - 1]
    sparse = torch.cat([tokens, tail], dim=1)
    is_sparse = complete > keep
    positions = torch.where(is_sparse[:, None], sparse, dense)
    counts = torch.where(is_sparse, keep * kpool + open_tail, visible)
    positions = torch.where(columns[None, :] < counts[:, None], positions, 0)
    return DeviceSelection(positions.to(torch.int32), counts.to(torch.int32), is_sparse.to(torch.int32))


def select_decode_fused(
    indexer: PoolingIndexer, q: torch.Tensor, weights: torch.Tensor, batch: ForwardBatch
) -> DeviceSelection:
    """``select_decode`` on CUDA in three launches: every row's scores over its own complete pools, its
    ``select_pools`` best by a per-row radix select (exact ties to the lower pool, as the stable sort), and their
    expansion to token positions."""
    from dgpp.kernels.pooled_selection import pooled_positions_triton
    from dgpp.kernels.top_k_rows import top_k_rows_triton

    complete = batch.seq_lens // indexer.kpool  # padding rows (length 0) score and pick nothing
    scores = pooled_scores_fused(indexer, q, weights, batch, batch.block_tables, complete)
    pools = top_k_rows_triton(scores, complete, indexer.select_pools)[0]
    return DeviceSelection(
        *pooled_positions_triton(pools, batch.seq_lens, indexer.kpool, indexer.select_tail)
    )


def pooled_scores_fused(
    indexer: PoolingIndexer,
    q: torch.Tensor,
    weights: torch.Tensor,
    batch: ForwardBatch,
    tables: torch.Tensor,
    complete: torch.Tensor,
) -> torch.Tensor:
    """``[rows, pools the table holds]`` fp32 scores of each row's first ``complete[r]`` pools (``-inf`` past them)
    through row ``r``'s block table ``tables[r]``, the pooled keys read as a paged cache of one entry per pool.
    A score depends on its row's query and its pool's key alone (one fixed order of sums), so decode steps,
    prefill chunks and speculative verifies on CUDA score alike."""
    from dgpp.kernels.dsa_index import index_scores_triton
    from dgpp.nn.compressed_decode import entry_table

    cache = batch.cache.kv[indexer.cache_name][0]
    scales = batch.cache.kv_scales.get(indexer.cache_name)
    table = entry_table(tables, indexer.kpool, batch.cache.block_size).contiguous()
    # q holds the projection's values in fp32: in the keys' dtype again (exactly), e4m3 keys dequantize to it
    return index_scores_triton(
        q.to(indexer.dtype),
        weights,
        cache,
        table,
        complete,
        q.shape[-1] ** -0.5,
        None if scales is None else scales[0],
    )
