"""Tensor-core kernels for packed FP8 and FP4 weights at decode and serving batch sizes (any row count),
modelled on ``dgpp.kernels.gemv``.

Each program owns ``BN`` output rows of one weight and a block of ``BM`` x rows (16 up to 16 rows, 64 above:
``DECODE_BM`` / ``BATCH_BM``, grid axis 2) and walks its K slice (the slices are set by the shape, never by M):
every step is a tensor-core ``tl.dot`` in the activation dtype, so the packed bytes of a K tile are read and
decoded once for all rows of the block (a 64-row step reads each weight once, not once per 16 rows). Rows
never mix inside an MMA, and each output's chain over K is the same whatever ``BM`` is (the same dots in the
same order into one fp32 accumulator), so a row's result is the same bits whatever the batch (MTP verify
relies on it). The packed bytes are decoded in registers:

* FP8 E4M3 (``FMT_FP8_BLOCK``): codes upcast to the dot dtype (exact) by Triton's conversion or, with
  ``FP8_BITS``, by integer bit placement (``e4m3_asm``, off the conversion pipe); one dot per scale block
  along K, the fp32 partial multiplied by that block's scale. Per-channel (``FMT_FP8_CHANNEL``): one scale
  per output row, applied once after the K loop.
* E2M1 pairs (``FMT_FP4_E4M3`` NVFP4, ``FMT_FP4_E8M0`` MXFP4): decoded by inline-PTX byte permutes
  (``FAST_FP4``, exact values) or by shifting a nibble's magnitude into an fp16's exponent/mantissa
  (e2m1 × 2^-14, undone on the accumulator); the group scale multiplies in the dot dtype (exact in
  bf16); the per-tensor global scale is applied to the fp32 accumulator after the loop. The tile is
  built by ``fp4_tiles`` in the ``FP4_LAYOUT`` chosen; low nibbles (even columns) and high nibbles (odd
  columns) meet x split into even/odd columns in two dots, or are interleaved (``INTERLEAVE``) for one
  dot against contiguous x. ``X_HALVES``: x arrives already split, each K step's even columns then its odd
  ones (``x_halves``, a pre-pass once per launch), so each half is one contiguous load instead of every
  warp taking the step's x apart.

``DOT_FP32`` (fp32 activations, and the Triton interpreter whose bf16 is wrong) decodes and multiplies
in fp32 with IEEE dots instead.
"""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton
from dgpp.kernels.split_partials import (
    arrive_last,
    gather_partials,
    k_slice_range,
    publish_partial,
    row_block_ptrs,
)
from dgpp.quant.kernels.gemv_steps import quant_tile

FMT_FP8_BLOCK = 0
FMT_FP8_CHANNEL = 1
FMT_FP4_E4M3 = 2
FMT_FP4_E8M0 = 3

GLOBAL_NONE = 0
GLOBAL_MUL = 1
GLOBAL_DIV = 2

# x rows per MMA at decode size: batches of 1..16 share one padded tile; larger batches take row blocks of
# BATCH_BM (``decode_launch.row_block``), each program decoding its weight tile once for all of its rows
DECODE_BM = 16
BATCH_BM = 64


@triton.jit
def pick_segment(w0, s0, g0, w1, s1, g1, w2, s2, g2, n0, n1, n2, BN: tl.constexpr):
    """The weight (pointers, its BN output columns, its rows, its first output column) of this program's tile
    when up to three weights sit side by side: segment starts are BN-aligned, so a tile never straddles two."""
    start = tl.program_id(0) * BN
    w_ptr, s_ptr, g_ptr, local, n_rows = w0, s0, g0, start, n0
    seg1 = tl.cdiv(n0, BN) * BN
    seg2 = seg1 + tl.cdiv(n1, BN) * BN
    out_base = 0
    if start >= seg2:
        w_ptr, s_ptr, g_ptr, local, n_rows, out_base = w2, s2, g2, start - seg2, n2, n0 + n1
    elif start >= seg1:
        w_ptr, s_ptr, g_ptr, local, n_rows, out_base = w1, s1, g1, start - seg1, n1, n0
    return w_ptr, s_ptr, g_ptr, local + tl.arange(0, BN), n_rows, out_base


@triton.jit
def quant_multi_gemv_kernel(
    x_ptr,
    w0,
    s0,
    g0,
    w1,
    s1,
    g1,
    w2,
    s2,
    g2,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    m,
    k_dim,
    k_per_split,
    n0,
    n1,
    n2,
    x_stride,
    out_stride,
    BM: tl.constexpr,
    SPLIT: tl.constexpr,
    FMT: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BKD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    W_AS_A: tl.constexpr,
    EVEN: tl.constexpr,
    FAST_FP4: tl.constexpr,
    FP8_BITS: tl.constexpr,
    FP4_LAYOUT: tl.constexpr,
    FP4_SCALES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCKS: tl.constexpr = 1,
    SCALES_AHEAD: tl.constexpr = False,
    X_HALVES: tl.constexpr = False,
):
    """Up to three weights of one format side by side (q/k/v): the program id picks the weight; segment
    starts are BN-aligned so a program never straddles two weights. Output columns are the concatenation.
    ``SPLIT`` > 1: grid axis 1 cuts K; each program publishes its fp32 partial and the last to arrive sums
    them in split order and stores (one launch, deterministic). Grid axis 2 walks blocks of ``BM`` rows."""
    w_ptr, s_ptr, g_ptr, cols, n_rows, out_base = pick_segment(
        w0, s0, g0, w1, s1, g1, w2, s2, g2, n0, n1, n2, BN
    )
    x_ptr, out_ptr, m = row_block_ptrs(x_ptr, out_ptr, m, x_stride, out_stride, BM)
    k_lo, k_hi = k_slice_range(k_dim, k_per_split)
    acc = quant_tile(
        x_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        m,
        k_dim,
        k_lo,
        k_hi,
        n_rows,
        x_stride,
        cols,
        BM,
        FMT,
        SBN,
        SBK,
        GLOBAL_OP,
        BN,
        BK,
        BKD,
        INTERLEAVE,
        W_AS_A,
        EVEN,
        FAST_FP4,
        FP8_BITS,
        FP4_LAYOUT,
        FP4_SCALES,
        DOT_FP32,
        DOT_DTYPE,
        BLOCKS,
        SCALES_AHEAD,
        X_HALVES,
    )
    rows = tl.arange(0, BM)
    out_ptrs = out_ptr + rows[None, :] * out_stride + (out_base + cols)[:, None]
    out_mask = (rows[None, :] < m) & (cols < n_rows)[:, None]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        publish_partial(ws_ptr, acc, 0, m, SPLIT, 1, BN, BM)
        if arrive_last(cnt_ptr, SPLIT):
            tl.store(
                out_ptrs,
                gather_partials(ws_ptr, 0, m, SPLIT, 1, BN, BM).to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )


@triton.jit
def quant_gate_up_silu_kernel(
    x_ptr,
    wg,
    sg,
    gg,
    wu,
    su,
    gu,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    m,
    k_dim,
    k_per_split,
    n_rows,
    x_stride,
    out_stride,
    BM: tl.constexpr,
    SPLIT: tl.constexpr,
    FMT: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BKD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    W_AS_A: tl.constexpr,
    EVEN: tl.constexpr,
    FAST_FP4: tl.constexpr,
    FP8_BITS: tl.constexpr,
    FP4_LAYOUT: tl.constexpr,
    FP4_SCALES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCKS: tl.constexpr = 1,
    SCALES_AHEAD: tl.constexpr = False,
    X_HALVES: tl.constexpr = False,
):
    """``silu(x wg^T) * (x wu^T)`` for BN intermediate columns (split-K and row blocks as in the q/k/v kernel)."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    x_ptr, out_ptr, m = row_block_ptrs(x_ptr, out_ptr, m, x_stride, out_stride, BM)
    k_lo, k_hi = k_slice_range(k_dim, k_per_split)
    gate = quant_tile(
        x_ptr,
        wg,
        sg,
        gg,
        m,
        k_dim,
        k_lo,
        k_hi,
        n_rows,
        x_stride,
        cols,
        BM,
        FMT,
        SBN,
        SBK,
        GLOBAL_OP,
        BN,
        BK,
        BKD,
        INTERLEAVE,
        W_AS_A,
        EVEN,
        FAST_FP4,
        FP8_BITS,
        FP4_LAYOUT,
        FP4_SCALES,
        DOT_FP32,
        DOT_DTYPE,
        BLOCKS,
        SCALES_AHEAD,
        X_HALVES,
    )
    up = quant_tile(
        x_ptr,
        wu,
        su,
        gu,
        m,
        k_dim,
        k_lo,
        k_hi,
        n_rows,
        x_stride,
        cols,
        BM,
        FMT,
        SBN,
        SBK,
        GLOBAL_OP,
        BN,
        BK,
        BKD,
        INTERLEAVE,
        W_AS_A,
        EVEN,
        FAST_FP4,
        FP8_BITS,
        FP4_LAYOUT,
        FP4_SCALES,
        DOT_FP32,
        DOT_DTYPE,
        BLOCKS,
        SCALES_AHEAD,
        X_HALVES,
    )
    rows = tl.arange(0, BM)
    out_ptrs = out_ptr + rows[None, :] * out_stride + cols[:, None]
    out_mask = (rows[None, :] < m) & (cols < n_rows)[:, None]
    if SPLIT == 1:
        tl.store(out_ptrs, swiglu(gate, up, out_ptr.dtype.element_ty), mask=out_mask)
    else:
        publish_partial(ws_ptr, gate, 0, m, SPLIT, 2, BN, BM)
        publish_partial(ws_ptr, up, 1, m, SPLIT, 2, BN, BM)
        if arrive_last(cnt_ptr, SPLIT):
            gate = gather_partials(ws_ptr, 0, m, SPLIT, 2, BN, BM)
            up = gather_partials(ws_ptr, 1, m, SPLIT, 2, BN, BM)
            tl.store(out_ptrs, swiglu(gate, up, out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def swiglu(gate, up, OUT_DTYPE: tl.constexpr):
    """silu(gate) * up with both rounded to the output dtype first, as the eager layer's activations are."""
    gate = gate.to(OUT_DTYPE).to(tl.float32)
    up = up.to(OUT_DTYPE).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(OUT_DTYPE)
