"""A decode step of a window compressor (``dgpp.nn.window_compressor``): the gated softmax pool of the window a
row closes, and the row's projections buffered in the per-request ring, for one row per sequence.

``kv``/``gate [R, width]`` are this step's projections; the ring ``[slots, cap, width]`` holds the ``cap``
positions before each row (position ``j`` at ``j % cap``). The row at ``pos`` pools the ``span`` rows
``pos - span + 1 .. pos`` (``span = cap``: ``2r`` when overlapping, else ``r``): per channel ``c`` of the
``d``-wide output, ``Σ_i softmax_i(gate_i + ape_i) · kv_i`` over those rows (softmax in fp32, weights rounded to
``kv``'s dtype as the reference does), where an overlapping pool reads channel ``c`` of the first ``r`` rows and
``d + c`` of the last ``r``, and a row before position 0 has zero weight. Only a row that closes a window
(``(pos + 1) % r == 0``) pools; the others get zeros. Every live row then writes its ``kv``/``gate`` into the
ring (after the read: the slot it writes is not one it pools). A padding row (state slot -1 or ``seq_lens``
0) writes nothing. Returns the pooled rows ``[R, d]`` before the compressor's norm and rotation.

The Triton kernel gives one program to each (row, block of channels) and loads the span's rows of its
channels once; nothing reads a host value, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.masked_rows import store_rows

_TILE = 4096  # span rows x channels per program


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
def _window_pool_kernel(
    kv_ptr,
    gate_ptr,
    ring_kv_ptr,
    ring_gate_ptr,
    ape_ptr,
    slot_ptr,
    pos_ptr,
    len_ptr,
    out_ptr,
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
    o_r,
    OVERLAP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < dim
    pos = tl.load(pos_ptr + r)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    live = (slot >= 0) & (tl.load(len_ptr + r) > 0)
    slot = tl.maximum(slot, 0)
    closes = live & ((pos + 1) % ratio == 0)
    pooled = tl.zeros([BLOCK_C], tl.float32)
    if closes:
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
            ring_kv_ptr + slot * rkv_s + ring_row[:, None] * rkv_t + ch,
            mask=from_ring[:, None] & m2,
            other=0.0,
        )
        ring_gate = tl.load(
            ring_gate_ptr + slot * rg_s + ring_row[:, None] * rg_t + ch,
            mask=from_ring[:, None] & m2,
            other=0.0,
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
    tl.store(out_ptr + r * o_r + c, pooled.to(out_ptr.dtype.element_ty), mask=cmask)
    # every live row buffers its projections (the whole width: programs split it by their channel blocks)
    width = 2 * dim if OVERLAP else dim
    own = pos % cap
    for half in tl.static_range(2 if OVERLAP else 1):
        w = c + half * dim
        wmask = live & cmask & (w < width)
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


def window_pool_decode_triton(
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
    rows, width = kv.shape
    dim = width // 2 if overlap else width
    out = torch.empty(rows, dim, dtype=kv.dtype, device=kv.device)
    if rows == 0:
        return out
    cap = ring_kv.shape[1]
    block_s = next_pow2(cap)
    block_c = min(next_pow2(dim), max(16, _TILE // block_s))
    ape = ape.float()
    _window_pool_kernel[(rows, triton.cdiv(dim, block_c))](
        kv,
        gate,
        ring_kv,
        ring_gate,
        ape,
        slots,
        positions,
        seq_lens,
        out,
        ratio,
        dim,
        cap,
        kv.stride(0),
        gate.stride(0),
        ring_kv.stride(0),
        ring_kv.stride(1),
        ring_gate.stride(0),
        ring_gate.stride(1),
        ape.stride(0),
        out.stride(0),
        OVERLAP=overlap,
        BLOCK_S=block_s,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return out


def window_pool_decode(
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
    """Pooled rows ``[R, d]`` (zeros where no window closes) and the ring written; Triton on CUDA, torch elsewhere."""
    fn = window_pool_decode_triton if use_triton(kv) else window_pool_decode_ref
    return fn(kv, gate, ring_kv, ring_gate, ape, slots, positions, seq_lens, ratio, overlap)
