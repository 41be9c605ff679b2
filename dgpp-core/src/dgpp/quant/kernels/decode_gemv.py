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
  dot against contiguous x.

``DOT_FP32`` (fp32 activations, and the Triton interpreter whose bf16 is wrong) decodes and multiplies
in fp32 with IEEE dots instead.
"""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton
from dgpp.quant.kernels.fp4_tiles import fp4_flat_weights, fp4_grouped_weights
from dgpp.quant.kernels.gemv_steps import (
    block_rows,
    finish_block,
    fp4_step,
    fp8_step,
    fp8_values,
    joined_rows,
    w_tile,
)
from dgpp.quant.kernels.split_partials import (
    arrive_last,
    gather_partials,
    k_slice_range,
    publish_partial,
    row_block_ptrs,
)

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
def quant_tile(
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
    BM: tl.constexpr,
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
):
    """``W[cols] @ x[:BM]^T`` as fp32 [BN, BM] for one packed weight (all scales applied). Each output's
    chain over K (the dots, their widths and order, where the scales enter) is fixed by the format, ``BK``,
    ``BKD`` and the K slice: never by ``BM``, so a row gets the same bits in a 16-row and a 64-row block.
    ``BLOCKS`` > 1: the BM rows run as BLOCKS blocks of BM / BLOCKS rows, each decoded weight tile meeting
    every block in the dot a BM / BLOCKS-row program issues (``row_blocks``).

    FP8: ``BKD`` logical columns per dot (divides ``SBK`` for block scales), ``BK // BKD`` dots per step.
    FP4: ``BK`` logical columns per step, ``SBK`` = group size."""
    ROWS: tl.constexpr = BM // BLOCKS
    col_ok = cols < n_rows
    if W_AS_A:
        acc0 = tl.zeros([BN, ROWS], tl.float32)
    else:
        acc0 = tl.zeros([ROWS, BN], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    if FMT <= 1:
        w_rows = w_ptr + cols[:, None].to(tl.int64) * k_dim
        scale_cols = tl.cdiv(k_dim, SBK)
        for k0 in range(k_lo, k_hi, BK):
            for j in tl.static_range(BK // BKD):
                kd = k0 + j * BKD
                kk = kd + tl.arange(0, BKD)
                codes = w_tile(w_rows + kk[None, :], col_ok, kk < k_hi, EVEN)
                wv = fp8_values(codes, FP8_BITS, DOT_FP32, DOT_DTYPE)
                s = 1.0
                if FMT == 0:
                    s_ptrs = s_ptr + (cols // SBN) * scale_cols + kd // SBK
                    if EVEN:
                        s = tl.load(s_ptrs).to(tl.float32)
                    else:
                        s = tl.load(s_ptrs, mask=col_ok & (kd < k_hi), other=0.0).to(tl.float32)
                acc0 = fp8_step(
                    acc0,
                    x_ptr,
                    block_rows(0, ROWS),
                    m,
                    x_stride,
                    kk,
                    k_hi,
                    wv,
                    s,
                    FMT,
                    W_AS_A,
                    EVEN,
                    DOT_FP32,
                    DOT_DTYPE,
                )
                if BLOCKS > 1:
                    acc1 = fp8_step(
                        acc1,
                        x_ptr,
                        block_rows(1, ROWS),
                        m,
                        x_stride,
                        kk,
                        k_hi,
                        wv,
                        s,
                        FMT,
                        W_AS_A,
                        EVEN,
                        DOT_FP32,
                        DOT_DTYPE,
                    )
                if BLOCKS > 2:
                    acc2 = fp8_step(
                        acc2,
                        x_ptr,
                        block_rows(2, ROWS),
                        m,
                        x_stride,
                        kk,
                        k_hi,
                        wv,
                        s,
                        FMT,
                        W_AS_A,
                        EVEN,
                        DOT_FP32,
                        DOT_DTYPE,
                    )
                    acc3 = fp8_step(
                        acc3,
                        x_ptr,
                        block_rows(3, ROWS),
                        m,
                        x_stride,
                        kk,
                        k_hi,
                        wv,
                        s,
                        FMT,
                        W_AS_A,
                        EVEN,
                        DOT_FP32,
                        DOT_DTYPE,
                    )
    else:
        row_bytes = k_dim // 2
        if (
            EVEN and BK >= 32
        ):  # K is a multiple of BK: rows start 16-byte aligned, so loads vectorize to 16 bytes
            row_bytes = tl.multiple_of(row_bytes, 16)
        w_rows = w_ptr + cols[:, None].to(tl.int64) * row_bytes
        for k0 in range(k_lo, k_hi, BK):
            if FP4_LAYOUT == 1:
                lo, hi = fp4_flat_weights(
                    w_rows,
                    s_ptr,
                    cols,
                    col_ok,
                    k0,
                    k_dim,
                    k_hi,
                    FMT,
                    SBK,
                    BN,
                    BK,
                    EVEN,
                    FAST_FP4,
                    FP4_SCALES,
                    DOT_DTYPE,
                )
            else:
                lo, hi = fp4_grouped_weights(
                    w_rows, s_ptr, cols, col_ok, k0, k_dim, k_hi, FMT, SBK, BN, BK, EVEN, FAST_FP4, DOT_DTYPE
                )
            acc0 = fp4_step(
                acc0,
                x_ptr,
                block_rows(0, ROWS),
                m,
                x_stride,
                k0,
                k_hi,
                lo,
                hi,
                ROWS,
                BK,
                INTERLEAVE,
                W_AS_A,
                EVEN,
                FP4_LAYOUT,
                DOT_FP32,
                DOT_DTYPE,
            )
            if BLOCKS > 1:
                acc1 = fp4_step(
                    acc1,
                    x_ptr,
                    block_rows(1, ROWS),
                    m,
                    x_stride,
                    k0,
                    k_hi,
                    lo,
                    hi,
                    ROWS,
                    BK,
                    INTERLEAVE,
                    W_AS_A,
                    EVEN,
                    FP4_LAYOUT,
                    DOT_FP32,
                    DOT_DTYPE,
                )
            if BLOCKS > 2:
                acc2 = fp4_step(
                    acc2,
                    x_ptr,
                    block_rows(2, ROWS),
                    m,
                    x_stride,
                    k0,
                    k_hi,
                    lo,
                    hi,
                    ROWS,
                    BK,
                    INTERLEAVE,
                    W_AS_A,
                    EVEN,
                    FP4_LAYOUT,
                    DOT_FP32,
                    DOT_DTYPE,
                )
                acc3 = fp4_step(
                    acc3,
                    x_ptr,
                    block_rows(3, ROWS),
                    m,
                    x_stride,
                    k0,
                    k_hi,
                    lo,
                    hi,
                    ROWS,
                    BK,
                    INTERLEAVE,
                    W_AS_A,
                    EVEN,
                    FP4_LAYOUT,
                    DOT_FP32,
                    DOT_DTYPE,
                )
    acc0 = finish_block(acc0, s_ptr, g_ptr, cols, col_ok, FMT, GLOBAL_OP, W_AS_A, EVEN, FAST_FP4)
    if BLOCKS > 1:
        acc1 = finish_block(acc1, s_ptr, g_ptr, cols, col_ok, FMT, GLOBAL_OP, W_AS_A, EVEN, FAST_FP4)
    if BLOCKS > 2:
        acc2 = finish_block(acc2, s_ptr, g_ptr, cols, col_ok, FMT, GLOBAL_OP, W_AS_A, EVEN, FAST_FP4)
        acc3 = finish_block(acc3, s_ptr, g_ptr, cols, col_ok, FMT, GLOBAL_OP, W_AS_A, EVEN, FAST_FP4)
    return joined_rows(acc0, acc1, acc2, acc3, BLOCKS)


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
