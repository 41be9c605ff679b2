"""Window pooling: gated softmax pooling of every complete window of ``ratio`` token rows into one cache entry
(DeepSeek-V4's CSA / HCA and its lightning indexer's keys: ``WindowCompressor``; GLM-5.3-Flash's k-pooled index
keys subclass ``WindowPooler`` with their own projections).

Each row projects to K/V rows ``c = wkv(x)`` and gate logits ``z = wgate(x)``. Window ``w`` (positions
``w·r .. w·r + r - 1``) becomes, once its last row arrives, ``norm(Σ_j softmax_j(z_j + ape_j) ⊙ c_j)`` (the
softmax over the window's rows per channel, in fp32) with RoPE on the trailing dims at position ``w·r``.
``overlap`` (CSA): the projections are twice as wide and entry ``w`` pools ``2r`` rows, the first half of
window ``w - 1``'s rows (absent for ``w = 0``: zero weight) and the second half of window ``w``'s.

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
    """``(w · x̂).to(x.dtype)`` with ``w`` kept in fp32 and the product in fp32 (DeepSeek-V4's norms)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
    fp32 row scales (``engine.kv_dtype`` fp8 / fp4 index keys)."""
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

    def finish(self, pooled: torch.Tensor, window: int) -> torch.Tensor:
        """A pooled row ``[head_dim]`` as the cache keeps it (as is, unless a subclass norms or rotates it)."""
        return pooled

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, window: int) -> torch.Tensor:
        """Entry ``window`` from its rows: ``kv``/``gate`` ``[r or 2r, width]`` (the previous window's rows first
        when overlapping; only the current window's when ``window == 0``)."""
        r, d = self.ratio, self.head_dim
        bias = self.position_bias().float()
        gate = gate.float() + (bias if gate.shape[0] == r else bias.repeat(2, 1))
        if self.overlap:
            cur_kv, cur_gate = kv[-r:, d:], gate[-r:, d:]
            if window > 0:
                cur_kv = torch.cat([kv[:r, :d], cur_kv])
                cur_gate = torch.cat([gate[:r, :d], cur_gate])
            kv, gate = cur_kv, cur_gate
        weights = gate.softmax(dim=0, dtype=torch.float32).to(kv.dtype)
        return self.finish((kv * weights).sum(dim=0), window)

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
            done = range(ctx // r, end // r)  # windows whose last row is in this step
            if len(done):
                entries = []
                for w in done:
                    first = max(0, (w - 1) * r) if self.overlap else w * r
                    rows = slice(first - lo, (w + 1) * r - lo)
                    entries.append(self.pool(line_kv[rows], line_gate[rows], w))
                windows = torch.arange(done.start, done.stop, device=kv.device)
                slots = entry_slots(batch.block_tables[b], windows, r, block_size, pool.shape[1])
                store_entries(pool, None if scales is None else scales[0], slots, torch.stack(entries))
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

    def finish(self, pooled: torch.Tensor, window: int) -> torch.Tensor:
        position = torch.tensor([window * self.ratio], device=pooled.device)
        return self.rotary.rotate(self.norm(pooled)[None, None, :], position)[0, 0]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> None:
        """Project this step's rows and ``store`` them (pooling every window they complete)."""
        self.store(self.wkv(x), self.wgate(x), batch)
