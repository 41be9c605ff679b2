"""Decode steps of compressed attention on CUDA, batched over rows and free of host syncs (CUDA-graph safe).

The per-row reference (``dgpp.nn.compressed_attention``, ``dgpp.nn.window_compressor``) loops over sequences on
the host; a decode step (one row per sequence) here runs as a few batched ops instead, every row padded to the
same shapes: the window's ``W`` latent rows (ring + the row itself), and the sequence's compressed entries up
to what its block table can hold (``E`` = table width x block size / ratio), masked past the row's complete
windows. The compressor pools on every row and stores only where the row closes a window (``(p + 1) % r ==
0``); the indexer's top-k is a stable sort (ties to the lower entry). Padded graph rows (state slot -1,
``seq_len`` 0) read clamped indices and write nothing. ``tests/perf/check_deepseek_v4_cuda.py`` checks these
against the reference at release sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels.masked_rows import store_rows
from dgpp.step.batch import ForwardBatch


def _live(batch: ForwardBatch) -> torch.Tensor:
    return (batch.state_slots >= 0) & (batch.seq_lens > 0)


def entry_rows(pool: torch.Tensor, block_tables: torch.Tensor, ratio: int, block_size: int) -> torch.Tensor:
    """Flat pool rows of entries ``0 .. E-1`` of every sequence ``[B, E]`` (clamped where the table ends)."""
    width = block_tables.shape[1] * block_size
    entries = torch.arange(width // ratio, device=pool.device)
    last = (entries + 1) * ratio - 1
    blocks = block_tables.long().gather(1, (last // block_size)[None].expand(block_tables.shape[0], -1))
    return blocks.clamp(min=0) * pool.shape[1] + ((last % block_size) // ratio)[None]


def gather_visible_entries(
    pool: torch.Tensor, batch: ForwardBatch, ratio: int, picks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(entries ``[B, E, D]``, visible ``[B, E]``): entry ``w`` is visible to the row at ``p`` when complete.
    ``picks [B, k]``: only those entries of each row (the indexer's), read from the pool alone."""
    rows = entry_rows(pool, batch.block_tables, ratio, batch.cache.block_size)
    entry = torch.arange(rows.shape[1], device=pool.device)[None].expand_as(rows)
    if picks is not None:
        rows, entry = rows.gather(1, picks), picks
    flat = pool.view(-1, pool.shape[-1])
    entries = flat[rows.reshape(-1)].view(*rows.shape, -1)
    visible = entry < ((batch.positions + 1) // ratio)[:, None]
    return entries, visible & _live(batch)[:, None]


def compress_decode(comp, x: torch.Tensor, batch: ForwardBatch) -> None:
    """``WindowCompressor.forward`` for a decode step (one row per sequence)."""
    kv, gate = comp.wkv(x), comp.wgate(x)
    ring = batch.cache.state[comp.buffer_name]
    ring_kv, ring_gate = ring["kv"], ring["gate"]
    cap, r, d = ring_kv.shape[1], comp.ratio, comp.head_dim
    live = _live(batch)
    slots = batch.state_slots.clamp(min=0)
    pos = batch.positions
    span = 2 * r if comp.overlap else r  # rows entry w pools: the previous window's too when overlapping
    offsets = torch.arange(span - 1, device=x.device)
    old_pos = pos[:, None] - (span - 1) + offsets[None]  # the span's rows before this one, from the ring
    line_kv = torch.cat(
        [ring_kv[slots[:, None], old_pos.clamp(min=0) % cap], kv[:, None].to(ring_kv.dtype)], 1
    )
    line_gate = torch.cat(
        [ring_gate[slots[:, None], old_pos.clamp(min=0) % cap], gate[:, None].to(ring_gate.dtype)], 1
    )
    ape = comp.ape.repeat(span // r, 1)
    logits = line_gate + ape  # fp32
    if comp.overlap:
        prev = (old_pos[:, :r] < 0)[:, :, None]  # window w - 1 of window 0: absent
        kv_all = torch.cat([line_kv[:, :r, :d], line_kv[:, r:, d:]], 1)
        logits = torch.cat([logits[:, :r, :d].masked_fill(prev, float("-inf")), logits[:, r:, d:]], 1)
    else:
        kv_all = line_kv
    weights = logits.softmax(dim=1, dtype=torch.float32).to(kv_all.dtype)
    pooled = comp.norm((kv_all * weights).sum(dim=1))
    window = pos // r
    pooled = comp.rotary.rotate(pooled[:, None], window * r)[:, 0]
    pool = batch.cache.kv[comp.cache_name][0]
    last = (window + 1) * r - 1
    block = (
        batch.block_tables.long()
        .gather(1, (last // batch.cache.block_size).clamp(max=batch.block_tables.shape[1] - 1)[:, None])[:, 0]
        .clamp(min=0)
    )
    rows = block * pool.shape[1] + (last % batch.cache.block_size) // r
    closes = live & ((pos + 1) % r == 0)
    store_rows(pool.view(-1, pool.shape[-1]), rows, pooled, closes)
    ring_rows = slots * cap + pos % cap
    store_rows(ring_kv.view(-1, ring_kv.shape[-1]), ring_rows, kv, live)
    store_rows(ring_gate.view(-1, ring_gate.shape[-1]), ring_rows, gate, live)


def indexer_decode(indexer, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The indexer's picks ``[B, topk]`` (entries, ties to the lower one) and their validity, for a decode step;
    rows with fewer complete entries than ``topk`` pick them all (the rest invalid)."""
    compress_decode(indexer.compressor, x, batch)
    rows = x.shape[0]
    q = indexer.rotary.rotate(
        indexer.wq_b(q_resid).view(rows, indexer.num_heads, indexer.head_dim), batch.positions
    )
    weights = indexer.weights_proj(x).float() * indexer.num_heads**-0.5
    keys, visible = gather_visible_entries(
        batch.cache.kv[indexer.compressor.cache_name][0], batch, indexer.ratio
    )
    per_head = F.relu(torch.einsum("bhd,bed->bhe", q.float(), keys.float())) * indexer.head_dim**-0.5
    scores = (per_head * weights[:, :, None]).sum(dim=1).masked_fill(~visible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : indexer.topk]
    return order


def attend_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    batch: ForwardBatch,
    sinks: torch.Tensor,
    scale: float,
    window: int,
    entries: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """One softmax per row over its window (ring + itself), the given entries ``[B, E, D]`` where ``visible``,
    and the head's sink."""
    cap = ring.shape[1]
    slots = batch.state_slots.clamp(min=0)
    pos = batch.positions
    old_pos = pos[:, None] - cap + torch.arange(cap, device=q.device)[None]
    old = ring[slots[:, None], old_pos.clamp(min=0) % cap, 0]
    keys = torch.cat([old.to(kv.dtype), kv[:, None], entries.to(kv.dtype)], 1).float()
    valid = torch.cat([old_pos >= 0, torch.ones_like(pos, dtype=torch.bool)[:, None], visible], 1)
    scores = torch.einsum("bhd,bld->bhl", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    heads = q.shape[1]
    scores = torch.cat([scores, sinks.float()[None, :, None].expand(q.shape[0], heads, 1)], dim=-1)
    probs = scores.softmax(dim=-1)[..., :-1]
    return torch.einsum("bhl,bld->bhd", probs, keys).to(q.dtype)


def compressed_attention_decode(
    core,
    q: torch.Tensor,
    kv: torch.Tensor,
    x: torch.Tensor,
    q_resid: torch.Tensor,
    batch: ForwardBatch,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``CompressedSinkAttention`` of a compressed layer for a decode step (the ring write is the caller's)."""
    compress_decode(core.compressor, x, batch)
    pool = batch.cache.kv[core.compressor.cache_name][0]
    picks = indexer_decode(core.indexer, x, q_resid, batch) if core.indexer is not None else None
    entries, visible = gather_visible_entries(pool, batch, core.compressor.ratio, picks)
    ring = batch.cache.state[core.cache_name]["k"]
    return attend_decode(q, kv, ring, batch, sinks, core.scale, core.window, entries, visible)
