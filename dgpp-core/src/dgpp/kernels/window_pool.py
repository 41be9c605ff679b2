"""A decode step of a window compressor (``dgpp.nn.window_compressor``), one row per sequence: the gated softmax
pool of the window the row closes, its norm, rotation and store as a cache entry, and the row's projections
buffered in the per-request ring.

``kv``/``gate [R, width]`` are this step's projections; the ring ``[slots, cap, width]`` holds the ``cap``
positions before each row (position ``j`` at ``j % cap``). The row at ``pos`` pools the ``span`` rows
``pos - span + 1 .. pos`` (``span = cap``: ``2r`` when overlapping, else ``r``): per channel ``c`` of the
``d``-wide output, ``Σ_i softmax_i(gate_i + ape_i) · kv_i`` over those rows (softmax in fp32, weights rounded to
``kv``'s dtype as the reference does), where an overlapping pool reads channel ``c`` of the first ``r`` rows and
``d + c`` of the last ``r``, and a row before position 0 has zero weight. Only a row that closes a window
(``(pos + 1) % r == 0``) pools; every live row then writes its ``kv``/``gate`` into the ring (after the read:
the slot it writes is not one it pools). A padding row (state slot -1 or ``seq_lens`` 0) writes nothing.

``window_pool_decode_ref`` is the torch form of the pool and the ring write (the caller norms, rotates and
stores). ``window_compress_decode_triton`` does the whole step in one launch, one program per row: the pooled
row (a channel block at a time, the span's rows of those channels loaded once), its RMS norm and rotation
(``EntryFinish``), the store into the entry pool, and the ring write. Nothing reads a host value, so a launch
can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgpp.kernels._triton import next_pow2, tl, triton
from dgpp.kernels.masked_rows import store_rows

_TILE = 2048  # span rows x channels per step of a program (at 4096 an HCA span of 128 rows spills on sm_90)


class EntryFinish(NamedTuple):
    """What becomes of a pooled row: ``norm_weight`` (fp32) · row / rms(row) (``eps``), rounded, then the trailing
    ``rotary_dim`` channels turned in (2i, 2i + 1) pairs by ``inv_freq`` · the window's first position (times
    ``magnitude``), stored at the pool row of the window's last position (``block_tables``, ``block_size``)."""

    norm_weight: torch.Tensor
    eps: float
    inv_freq: torch.Tensor
    magnitude: float
    fp32_angles: bool
    rotary_dim: int
    pool: torch.Tensor
    block_tables: torch.Tensor
    block_size: int


def window_pool_decode_ref(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_gate: torch.Tensor,
    ape: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    ratio: int,
    overlap: bool,
) -> torch.Tensor:
    """Batched torch form (no host sync): every row pools, closing or not, and the result is masked."""
    cap, r = ring_kv.shape[1], ratio
    d = kv.shape[1] // 2 if overlap else kv.shape[1]
    live = (slots >= 0) & (seq_lens > 0)
    slot = slots.clamp(min=0)
    old_pos = positions[:, None] - (cap - 1) + torch.arange(cap - 1, device=kv.device)[None]
    old = (slot[:, None], old_pos.clamp(min=0) % cap)
    line_kv = torch.cat([ring_kv[old], kv[:, None].to(ring_kv.dtype)], 1)
    logits = torch.cat([ring_gate[old], gate[:, None].to(ring_gate.dtype)], 1) + ape.repeat(cap // r, 1)
    before = torch.cat([old_pos < 0, torch.zeros_like(live)[:, None]], 1)[:, :, None]
    logits = logits.masked_fill(before, float("-inf"))
    if overlap:
        line_kv = torch.cat([line_kv[:, :r, :d], line_kv[:, r:, d:]], 1)
        logits = torch.cat([logits[:, :r, :d], logits[:, r:, d:]], 1)
    weights = logits.softmax(dim=1, dtype=torch.float32).to(line_kv.dtype)
    pooled = (line_kv * weights).sum(dim=1)
    closes = live & ((positions + 1) % r == 0)
    ring_rows = slot * cap + positions % cap
    store_rows(ring_kv.view(-1, ring_kv.shape[-1]), ring_rows, kv, live)
    store_rows(ring_gate.view(-1, ring_gate.shape[-1]), ring_rows, gate, live)
    return torch.where(closes[:, None], pooled, 0).to(kv.dtype)


@triton.jit
def _pool_channels(
    kv_ptr,
    gate_ptr,
    ring_kv_ptr,
    ring_gate_ptr,
    ape_ptr,
    r,
    slot,
    pos,
    c,
    ratio,
    dim,
    cap,
    kv_r,
    gate_r,
    rkv_s,
    rkv_t,
    rg_s,
    rg_t,
    ape_r,
    OVERLAP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Pooled channels ``c`` of the window row ``r`` closes, fp32 values of ``kv``'s dtype."""
    cmask = c < dim
    i = tl.arange(0, BLOCK_S)  # span row i: position pos - cap + 1 + i; the last one is this step's
    row_pos = pos - cap + 1 + i
    in_span = i < cap
    from_ring = in_span & (i < cap - 1) & (row_pos >= 0)
    current = i == cap - 1
    ch = c[None, :]
    if OVERLAP:  # the previous window's rows read the first half, this window's the second
        ch = tl.where((i >= ratio)[:, None], ch + dim, ch)
    ring_row = (tl.where(from_ring, row_pos, 0) % cap).to(tl.int64)
    m2 = cmask[None, :]
    ring_kv = tl.load(
        ring_kv_ptr + slot * rkv_s + ring_row[:, None] * rkv_t + ch, mask=from_ring[:, None] & m2, other=0.0
    )
    ring_gate = tl.load(
        ring_gate_ptr + slot * rg_s + ring_row[:, None] * rg_t + ch, mask=from_ring[:, None] & m2, other=0.0
    )
    new_kv = tl.load(kv_ptr + r * kv_r + ch, mask=current[:, None] & m2, other=0.0)
    new_gate = tl.load(gate_ptr + r * gate_r + ch, mask=current[:, None] & m2, other=0.0)
    rows_kv = ring_kv + new_kv.to(ring_kv.dtype)
    ape = tl.load(ape_ptr + (i % ratio)[:, None] * ape_r + ch, mask=in_span[:, None] & m2, other=0.0)
    logits = (ring_gate + new_gate.to(ring_gate.dtype)).to(tl.float32) + ape
    logits = tl.where((from_ring | current)[:, None], logits, float("-inf"))
    top = tl.max(logits, axis=0)
    e = tl.exp(logits - top[None, :])
    weights = (e / tl.sum(e, axis=0)[None, :]).to(rows_kv.dtype)
    pooled = tl.sum((rows_kv * weights).to(tl.float32), axis=0)
    return pooled.to(kv_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _window_compress_kernel(
    kv_ptr,
    gate_ptr,
    ring_kv_ptr,
    ring_gate_ptr,
    ape_ptr,
    norm_ptr,
    freq_ptr,
    slot_ptr,
    pos_ptr,
    len_ptr,
    bt_ptr,
    pool_ptr,
    scratch_ptr,
    ratio,
    dim,
    cap,
    rot_dim,
    block_size,
    eps,
    magnitude,
    kv_r,
    gate_r,
    rkv_s,
    rkv_t,
    rg_s,
    rg_t,
    ape_r,
    bt_r,
    pool_b,
    pool_e,
    OVERLAP: tl.constexpr,
    ROUND_ANGLES: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + r).to(tl.int32)  # 32-bit index math: 64-bit division costs registers
    slot = tl.load(slot_ptr + r).to(tl.int64)
    live = (slot >= 0) & (tl.load(len_ptr + r) > 0)
    slot = tl.maximum(slot, 0)
    if live & ((pos + 1) % ratio == 0):  # the row closes a window: pool, norm, rotate, store it
        sumsq = 0.0
        for c0 in range(0, dim, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            pooled = _pool_channels(
                kv_ptr,
                gate_ptr,
                ring_kv_ptr,
                ring_gate_ptr,
                ape_ptr,
                r,
                slot,
                pos,
                c,
                ratio,
                dim,
                cap,
                kv_r,
                gate_r,
                rkv_s,
                rkv_t,
                rg_s,
                rg_t,
                ape_r,
                OVERLAP,
                BLOCK_S,
            )
            sumsq += tl.sum(pooled * pooled, axis=0)
            tl.store(scratch_ptr + r * dim + c, pooled, mask=c < dim)
        tl.debug_barrier()  # the pooled row, written across the program's threads, is read back by others
        inv_rms = 1.0 / tl.sqrt(sumsq / dim + eps)
        block = tl.load(bt_ptr + r * bt_r + pos // block_size).to(tl.int64)
        dest = pool_ptr + block * pool_b + ((pos % block_size) // ratio) * pool_e
        out_ty = pool_ptr.dtype.element_ty
        nope = dim - rot_dim
        for c0 in range(0, nope, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cmask = c < nope
            x = tl.load(scratch_ptr + r * dim + c, mask=cmask, other=0.0)
            w = tl.load(norm_ptr + c, mask=cmask, other=0.0)
            tl.store(dest + c, (w * (x * inv_rms)).to(out_ty), mask=cmask)
        # the trailing rot_dim channels: normed, rounded, then pairs (2i, 2i + 1) turned at the window's first
        # position, angles rounded to the row's dtype unless kept in fp32
        i = tl.arange(0, BLOCK_R)
        imask = i < rot_dim // 2
        even = nope + 2 * i
        w_e = tl.load(norm_ptr + even, mask=imask, other=0.0)
        w_o = tl.load(norm_ptr + even + 1, mask=imask, other=0.0)
        x_e = (w_e * (tl.load(scratch_ptr + r * dim + even, mask=imask, other=0.0) * inv_rms)).to(out_ty)
        x_o = (w_o * (tl.load(scratch_ptr + r * dim + even + 1, mask=imask, other=0.0) * inv_rms)).to(out_ty)
        x_e, x_o = x_e.to(tl.float32), x_o.to(tl.float32)
        angle = (pos + 1 - ratio).to(tl.float32) * tl.load(freq_ptr + i, mask=imask, other=0.0)
        cos = tl.cos(angle) * magnitude
        sin = tl.sin(angle) * magnitude
        if ROUND_ANGLES:
            cos = cos.to(out_ty).to(tl.float32)
            sin = sin.to(out_ty).to(tl.float32)
        tl.store(dest + even, (x_e * cos - x_o * sin).to(out_ty), mask=imask)
        tl.store(dest + even + 1, (x_o * cos + x_e * sin).to(out_ty), mask=imask)
    # every live row buffers its projections (the slot it writes is not one it pooled from)
    width = 2 * dim if OVERLAP else dim
    own = pos % cap
    for c0 in range(0, width, BLOCK_W):
        w = c0 + tl.arange(0, BLOCK_W)
        wmask = live & (w < width)
        tl.store(
            ring_kv_ptr + slot * rkv_s + own * rkv_t + w,
            tl.load(kv_ptr + r * kv_r + w, mask=wmask),
            mask=wmask,
        )
        tl.store(
            ring_gate_ptr + slot * rg_s + own * rg_t + w,
            tl.load(gate_ptr + r * gate_r + w, mask=wmask),
            mask=wmask,
        )


def window_compress_decode_triton(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ring_kv: torch.Tensor,
    ring_gate: torch.Tensor,
    ape: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    ratio: int,
    overlap: bool,
    finish: EntryFinish,
) -> None:
    """The whole decode step of a compressor in one launch: pool, ``finish`` (norm, rotation) and the store of
    the entries rows close, and the ring write."""
    rows, width = kv.shape
    if rows == 0:
        return
    dim = width // 2 if overlap else width
    if finish.rotary_dim > dim or finish.rotary_dim % 2:
        raise ValueError(f"rotary_dim {finish.rotary_dim} must be even and at most the entry width {dim}")
    cap = ring_kv.shape[1]
    block_s = next_pow2(cap)
    scratch = torch.empty(rows, dim, dtype=torch.float32, device=kv.device)
    ape = ape.float()
    pool = finish.pool
    _window_compress_kernel[(rows,)](
        kv,
        gate,
        ring_kv,
        ring_gate,
        ape,
        finish.norm_weight,
        finish.inv_freq,
        slots,
        positions,
        seq_lens,
        finish.block_tables,
        pool,
        scratch,
        ratio,
        dim,
        cap,
        finish.rotary_dim,
        finish.block_size,
        float(finish.eps),
        float(finish.magnitude),
        kv.stride(0),
        gate.stride(0),
        ring_kv.stride(0),
        ring_kv.stride(1),
        ring_gate.stride(0),
        ring_gate.stride(1),
        ape.stride(0),
        finish.block_tables.stride(0),
        pool.stride(0),
        pool.stride(1),
        OVERLAP=overlap,
        ROUND_ANGLES=not finish.fp32_angles,
        BLOCK_S=block_s,
        BLOCK_C=min(next_pow2(dim), max(16, _TILE // block_s)),
        BLOCK_R=max(2, next_pow2(finish.rotary_dim // 2)),
        BLOCK_W=min(next_pow2(width), 1024),
        num_warps=4,
    )
