"""DeepSeek-V4.1-Flash's decode rows on the device: the compressor's group update, the indexer's selection and the
candidate pool of a decode step (every row one token of its own sequence) in batched ops that read no host value.

The per-sequence forms (``CompressorV41.forward``, ``IndexerV41.forward``) loop over the step's sequences on the
host; a decode step here computes every row at once and masks what a row must not write:

- compressor: the row at ``p`` joins its open group (at ratio 2 the buffered row of ``p - 1`` before it); every
  row pools its group as if complete, and only the rows that close one (``(p + 1) % r == 0``) store the entry and
  its index key; the others store their row in the open-group buffer;
- indexer: each row scores every entry of its table (-inf past the ``(p + 1) // r`` it sees), keeps the candidate
  source's blocks (``candidate_rows``, per row) or restricts to them, then its ``topk`` best (ties to the lower
  entry), as ascending entry ids with a count (``DecodePicks``): the table the packed attention reads. A decode
  graph's table spans the whole pool, so on Triton devices the top-k reads each row's own entries only
  (``kernel_picks``); the torch form sorts the row.

Every per-row value is computed by the same ops as the per-sequence forms (batch-invariant linears, norms and
softmax), so a row's entries and picks have the same bits either way. Padding rows (state slot -1 or ``seq_len``
0, as the decode graphs pad) read clamped indices, write nothing and pick nothing. ``fused``: masked stores in one
Triton launch (``dgpp.kernels.masked_rows``), else the torch reference's boolean-mask store.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from dgpp.kernels.masked_rows import store_rows_ref, store_rows_triton
from dgpp.kernels.top_k_rows import top_k_rows_triton
from dgpp.nn.compressed_decode import entry_table
from dgpp.plugin_api import ForwardBatch


class DecodeCompressor(Protocol):
    """What a decode step reads of a V4.1 compressor (``dgpp_deepseek.v41_indexer.CompressorV41``)."""

    @property
    def ratio(self) -> int: ...

    @property
    def buffer_name(self) -> str: ...

    @property
    def cache_name(self) -> str: ...

    @property
    def index_name(self) -> str: ...

    def pool_groups(self, kv: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor: ...

    def entry_rows(
        self, latent: torch.Tensor, entries: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecodePicks(NamedTuple):
    """A decode step's selection: ``picks [R, K]`` int32 entry ids, ascending, the first ``counts [R]`` real."""

    picks: torch.Tensor
    counts: torch.Tensor


def live_rows(batch: ForwardBatch) -> torch.Tensor:
    """bool ``[R]``: the rows that belong to a sequence (not a graph's padding)."""
    return (batch.state_slots >= 0) & (batch.seq_lens > 0)


def _store(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, keep: torch.Tensor, fused: bool) -> None:
    (store_rows_triton if fused else store_rows_ref)(dst, rows, src, keep)


def entry_rows_of(
    batch: ForwardBatch, entries: torch.Tensor, ratio: int, rows_per_block: int
) -> torch.Tensor:
    """Flat pool rows of one entry per row (``entries [R]``, in the block of its group's last position); padding
    rows' clamp to a real row, which a masked store leaves alone."""
    last = (entries + 1) * ratio - 1
    block_size, width = batch.cache.block_size, batch.block_tables.shape[1]
    column = (last // block_size).clamp(max=width - 1)[:, None]
    block = batch.block_tables.gather(1, column)[:, 0].long().clamp(min=0)
    return block * rows_per_block + (last % block_size) // ratio


def compress_decode_rows(
    comp: DecodeCompressor, kv: torch.Tensor, gate: torch.Tensor | None, batch: ForwardBatch, fused: bool
) -> None:
    """``CompressorV41.forward`` of a decode step, given the rows' projections ``kv`` (and ``gate`` at ratio > 1)."""
    r = comp.ratio
    pos = batch.positions.long()
    live = live_rows(batch)
    phase = pos % r
    if gate is None:  # ratio 1: every row is its own group
        latent = comp.pool_groups(kv[:, None], None)
    else:
        ring = batch.cache.state[comp.buffer_name]
        slot = batch.state_slots.long().clamp(min=0)
        here = (torch.arange(r, device=kv.device)[None, :] == phase[:, None])[..., None]
        rows_kv = torch.where(here, kv.to(ring["kv"].dtype)[:, None], ring["kv"][slot])
        rows_gate = torch.where(here, gate.to(ring["gate"].dtype)[:, None], ring["gate"][slot])
        # a row that leaves its group open waits in the buffer for the rows after it
        buffered = live & (phase != r - 1)
        at = slot * r + phase
        for name, rows in (("kv", kv), ("gate", gate)):
            flat = ring[name].view(-1, ring[name].shape[-1])
            _store(flat, at, rows.to(flat.dtype), buffered, fused)
        latent = comp.pool_groups(rows_kv, rows_gate)
    entries = pos // r
    main, keys = comp.entry_rows(latent, entries)
    closes = live & (phase == r - 1)
    for name, rows in ((comp.cache_name, main), (comp.index_name, keys)):
        target = batch.cache.kv[name][0]
        flat = target.view(-1, target.shape[-1])
        _store(flat, entry_rows_of(batch, entries, r, target.shape[1]), rows.to(flat.dtype), closes, fused)


def decode_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool: torch.Tensor,
    batch: ForwardBatch,
    ratio: int,
    decode_keys: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """fp32 ``[R, E]`` index scores of every entry of each row's table, from the keys ``decode_keys`` gives for
    the pool's rows (the torch form of the scoring kernel, a batched matrix product: each row's the bits of the
    per-sequence form's product)."""
    table = entry_table(batch.block_tables, ratio, batch.cache.block_size)
    per_block = pool.shape[1]
    entry = torch.arange(table.shape[1] * per_block, device=q.device)
    rows = table[:, entry // per_block].long().clamp(min=0) * per_block + entry % per_block
    keys = decode_keys(pool.view(-1, pool.shape[-1])[rows])  # [R, E, dim] fp32
    return (weights[:, :, None] * torch.matmul(q, keys.transpose(1, 2)).clamp_min(0)).sum(1)


def ascending_picks(chosen: torch.Tensor, k: int) -> DecodePicks:
    """The entry ids of ``chosen [R, E]`` (at most ``k`` per row) in ascending order, zero-padded to ``k``."""
    width = chosen.shape[1]
    ids = torch.arange(width, device=chosen.device)
    order = torch.sort(torch.where(chosen, ids, width + ids), dim=1).values[:, : min(k, width)]
    picks = torch.where(order < width, order, 0).to(torch.int32)
    return DecodePicks(picks, chosen.sum(dim=1, dtype=torch.int32))


def kernel_picks(scores: torch.Tensor, visible: torch.Tensor, k: int) -> DecodePicks:
    """``ascending_picks(top_mask(scores, k), k)`` on Triton devices: each row's ``k`` best among its ``visible``
    entries by one radix-select launch that reads the row's own scores only (``dgpp.kernels.top_k_rows``, exact
    ties to the lower entry), then the picks whose score is -inf (fewer than ``k`` finite ones: unseen or outside
    the candidate blocks) dropped, the others kept in order (a sort of ``k`` columns, not of the table)."""
    picks, _ = top_k_rows_triton(scores, visible, k)
    width, taken = scores.shape[1], picks.shape[1]
    seen = torch.arange(taken, device=scores.device)[None] < visible[:, None]
    kept = seen & (scores.gather(1, picks.long()) > -math.inf)
    order = torch.sort(torch.where(kept, picks, width + picks), dim=1).values
    return DecodePicks(
        torch.where(order < width, order, 0).to(torch.int32), kept.sum(dim=1, dtype=torch.int32)
    )


def visible_entries(batch: ForwardBatch, ratio: int) -> torch.Tensor:
    """``[R]`` the entries each row sees, ``(p + 1) // r`` (0 on a padding row)."""
    return torch.where(live_rows(batch), (batch.positions.long() + 1) // ratio, 0)


def mask_unseen(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    ids = torch.arange(scores.shape[1], device=scores.device)
    return scores.masked_fill(ids[None] >= visible[:, None], -math.inf)
