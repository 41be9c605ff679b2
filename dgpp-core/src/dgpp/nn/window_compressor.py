"""Window pooling: gated softmax pooling of every complete window of ``ratio`` token rows into one cache entry
(DeepSeek-V4's CSA / HCA and its lightning indexer's keys: ``WindowCompressor``; GLM-5.3-Flash's k-pooled index
keys subclass ``WindowPooler`` with their own projections).

Each row projects to K/V rows ``c = wkv(x)`` and gate logits ``z = wgate(x)``. Window ``w`` (positions
``w·r .. w·r + r - 1``) becomes, once its last row arrives, ``norm(Σ_j softmax_j(z_j + ape_j) ⊙ c_j)`` (the
softmax over the window's rows per channel, in fp32) with RoPE on the trailing dims at position ``w·r``.
``overlap`` (CSA): the projections are twice as wide and entry ``w`` pools ``2r`` rows, the first half of
window ``w - 1``'s rows (absent for ``w = 0``: zero weight) and the second half of window ``w``'s. A step pools
every window it completes of a sequence in one batched ``pool`` call.

Entries go to the paged pool (``CompressedKV``: entry ``w`` in the block of position ``w·r + r - 1``; an entry
stored as e4m3 rows, GLM-5.3-Flash's index keys under ``engine.kv_dtype`` fp8 / fp4, is quantized as it is
written and dequantized as it is read: ``store_entries`` / ``entry_rows``); rows not yet pooled stay in a
per-request ring (``WindowBuffer``, the last ``r`` or ``2r`` positions). A window is
pooled from the same rows in the same order however the prompt was chunked, batched or restored from a
prefix-cache snapshot, so its entry has the same bits every time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from dgpp.kernels._triton import use_triton
from dgpp.kernels.kv_fp8 import dequantize_rows, quantize_rows
from dgpp.nn.linear import Linear
from dgpp.nn.norm import rms_normalize
from dgpp.nn.rotary import TrailingRotary
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import CacheSpec, CompressedKV, WindowBuffer


class SeqRows(NamedTuple):
    """One sequence of a step: its index, first row, row count, positions ``ctx .. end - 1`` and state slot."""

    index: int
    start: int
    q_len: int
    ctx: int
    end: int
    slot: int


def live_sequences(batch: ForwardBatch) -> Iterator[SeqRows]:
    """The step's sequences that carry rows and own a state slot (padding sequences are skipped)."""
    start = 0
    for b, q_len in enumerate(batch.q_lens_cpu):
        slot = int(batch.state_slots[b])
        if q_len and slot >= 0:
            yield SeqRows(b, start, q_len, batch.context_lens_cpu[b], batch.seq_lens_cpu[b], slot)
        start += q_len


class FP32WeightRMSNorm(nn.Module):
    """``(w · x̂).to(x.dtype)`` with ``w`` kept in fp32 and the product in fp32 (DeepSeek-V4's norms). On CUDA one
    launch reads ``x`` and the fp32 weight and writes ``x``'s dtype (``dgpp.kernels.rms_norm`` with the fp32
    product), where the torch chain launches the upcast, the norm, the product and the cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from dgpp import kernels

            return kernels.rms_norm(x, self.weight, self.eps, None, 0.0, True)
        return (self.weight.float() * rms_normalize(x, self.eps)).to(x.dtype)


def entry_slots(
    block_table: torch.Tensor, entries: torch.Tensor, ratio: int, block_size: int, rows_per_block: int
) -> torch.Tensor:
    """Flat pool rows of entries ``entries`` of one sequence (each in the block of its window's last token)."""
    last = (entries + 1) * ratio - 1
    return block_table[last // block_size].long() * rows_per_block + (last % block_size) // ratio


def gather_entries(
    pool: torch.Tensor,
    block_table: torch.Tensor,
    count: int,
    ratio: int,
    block_size: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The first ``count`` entries of one sequence, ``[count, dim]``, in order; an e4m3 pool's with its row
    ``scale`` given, dequantized to ``dtype``."""
    entries = torch.arange(count, device=pool.device)
    return entry_rows(pool, scale, entry_slots(block_table, entries, ratio, block_size, pool.shape[1]), dtype)


def entry_rows(
    pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Pool rows at flat ``slots`` (any shape), ``[*slots.shape, dim]``: as stored, or (``scale``: the e4m3 pool's
    fp32 row scales) ``code * scale`` rounded once to ``dtype``."""
    flat = pool.view(-1, pool.shape[-1])
    if scale is None:
        return flat[slots]
    codes = flat.view(torch.uint8)[slots].view(pool.dtype)  # CPU float8 has no gather: move the bytes
    return dequantize_rows(codes, scale.view(-1, 1)[slots], dtype or torch.float32)


def store_entries(
    pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, rows: torch.Tensor
) -> None:
    """Write entry ``rows [n, dim]`` at flat ``slots``: as they are, or (``scale`` given) as e4m3 codes with their
    fp32 row scales (``engine.kv_dtype`` fp8 / fp4 index keys; on CUDA quantized and stored in one launch,
    ``dgpp.kernels.quantized_write``)."""
    if scale is not None and use_triton(rows):
        from dgpp import kernels

        kernels.write_quantized(pool, scale, rows[:, None], slots)
        return
    flat = pool.view(-1, pool.shape[-1])
    if scale is None:
        flat.index_copy_(0, slots, rows.to(flat.dtype))
        return
    codes, row_scale = quantize_rows(rows)
    flat.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
    scale.view(-1, 1).index_copy_(0, slots, row_scale)


class WindowPooler(nn.Module):
    """Pools every complete window of ``ratio`` rows into a ``CompressedKV`` entry and buffers the rows of the open
    window (a ``WindowBuffer`` ring). A subclass projects its rows and calls ``store``, and says what the softmax
    adds per window row (``position_bias``, ``[ratio, width]``) and what becomes of a pooled row (``finish``)."""

    def __init__(
        self, head_dim: int, ratio: int, cache_name: str, *, overlap: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        self.width = 2 * head_dim if overlap else head_dim
        self.cache_name = cache_name
        self.dtype = dtype

    @property
    def buffer_name(self) -> str:
        return f"{self.cache_name}.buffer"

    def cache_spec(self) -> dict[str, CacheSpec]:
        rows = 2 * self.ratio if self.overlap else self.ratio
        return {
            self.cache_name: CompressedKV.of(self.ratio, self.head_dim, self.dtype),
            self.buffer_name: WindowBuffer(rows=rows, width=self.width, dtype=self.dtype),
        }

    def position_bias(self) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, pooled: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Pooled rows ``[n, head_dim]`` of windows ``windows [n]`` as the cache keeps them (as is, unless a
        subclass norms or rotates them)."""
        return pooled

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Entries ``windows [n]`` from their rows: ``kv``/``gate`` ``[n, r or 2r, width]`` (the previous window's
        rows first when overlapping; only the window's own ``r`` when it is window 0) -> ``[n, head_dim]``. Each
        entry is its own softmax (fp32) and sum over dimension 1, so it has the same bits whatever shares the call."""
        r, d = self.ratio, self.head_dim
        bias = self.position_bias().float()
        gate = gate.float() + (bias if gate.shape[1] == r else bias.repeat(2, 1))
        if self.overlap:
            cur_kv, cur_gate = kv[:, -r:, d:], gate[:, -r:, d:]
            if kv.shape[1] == 2 * r:
                cur_kv = torch.cat([kv[:, :r, :d], cur_kv], dim=1)
                cur_gate = torch.cat([gate[:, :r, :d], cur_gate], dim=1)
            kv, gate = cur_kv, cur_gate
        # softmax spelled out: torch's CPU softmax over a middle dimension gave an entry other last bits with
        # the number of windows in the call (16-wide index keys)
        gate = (gate - gate.amax(dim=1, keepdim=True)).exp()
        weights = (gate / gate.sum(dim=1, keepdim=True)).to(kv.dtype)
        return self.finish((kv * weights).sum(dim=1), windows)

    def pool_span(
        self, line_kv: torch.Tensor, line_gate: torch.Tensor, lo: int, first: int, last: int
    ) -> torch.Tensor:
        """Entries ``first .. last - 1`` of one sequence from its timeline of rows (position ``lo`` first), in one
        ``pool`` call (window 0 of overlapping windows in a call of its own: it has no previous window)."""
        r = self.ratio
        span = 2 * r if self.overlap else r
        parts = []
        if self.overlap and first == 0:
            parts.append(
                self.pool(line_kv[None, :r], line_gate[None, :r], line_kv.new_zeros(1, dtype=torch.long))
            )
            first = 1
        if last > first:
            windows = torch.arange(first, last, device=line_kv.device)
            rows = (windows * r - (span - r) - lo)[:, None] + torch.arange(span, device=line_kv.device)
            parts.append(self.pool(line_kv[rows], line_gate[rows], windows))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def store(self, kv: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch) -> None:
        """Pool every window this step's rows (``kv``/``gate`` ``[T, width]``) complete into the pool, then buffer
        the rows the next windows still need."""
        ring = batch.cache.state[self.buffer_name]
        ring_kv, ring_gate = ring["kv"], ring["gate"]
        cap = ring_kv.shape[1]
        pool = batch.cache.kv[self.cache_name][0]
        scales = batch.cache.kv_scales.get(self.cache_name)
        r, block_size = self.ratio, batch.cache.block_size
        for seq in live_sequences(batch):
            b, start, q_len, ctx, end, slot = seq
            lo = max(0, ctx - cap)  # the timeline: buffered rows lo..ctx-1, then this step's rows
            old = torch.arange(lo, ctx, device=kv.device) % cap
            line_kv = torch.cat([ring_kv[slot, old], kv[start : start + q_len].to(ring_kv.dtype)])
            line_gate = torch.cat([ring_gate[slot, old], gate[start : start + q_len].to(ring_gate.dtype)])
            first, last = ctx // r, end // r  # the windows whose last row is in this step
            if last > first:
                windows = torch.arange(first, last, device=kv.device)
                slots = entry_slots(batch.block_tables[b], windows, r, block_size, pool.shape[1])
                entries = self.pool_span(line_kv, line_gate, lo, first, last)
                store_entries(pool, None if scales is None else scales[0], slots, entries)
            keep = max(ctx, end - cap)  # buffer the last `cap` positions, after reading the old ones
            idx = torch.arange(keep, end, device=kv.device) % cap
            ring_kv[slot, idx] = line_kv[keep - lo :]
            ring_gate[slot, idx] = line_gate[keep - lo :]


class WindowCompressor(WindowPooler):
    """``wkv`` / ``wgate`` / ``ape`` / ``norm`` of one compressor (the release's ``compressor.*`` names); a pooled
    row is normed and rotated at its window's first position."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        ratio: int,
        rotary: TrailingRotary,
        cache_name: str,
        *,
        overlap: bool,
        dtype: torch.dtype,
        eps: float,
    ) -> None:
        super().__init__(head_dim, ratio, cache_name, overlap=overlap, dtype=dtype)
        self.wkv = Linear(hidden_size, self.width, dtype=dtype)
        self.wgate = Linear(hidden_size, self.width, dtype=dtype)
        self.ape = nn.Parameter(torch.empty(ratio, self.width, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.ape, weight_loader=default_weight_loader)
        self.norm = FP32WeightRMSNorm(head_dim, eps)
        self.rotary = rotary

    def position_bias(self) -> torch.Tensor:
        return self.ape

    def finish(self, pooled: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        return self.rotary.rotate(self.norm(pooled)[:, None, :], windows * self.ratio)[:, 0]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> None:
        """Project this step's rows and ``store`` them (pooling every window they complete)."""
        self.store(self.wkv(x), self.wgate(x), batch)
