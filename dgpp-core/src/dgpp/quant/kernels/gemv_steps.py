"""The packed MMA GEMV's tile (``quant_tile``, which ``decode_gemv``'s kernels launch) and its steps: the per-block
FP8 and FP4 steps (their operands and dots: ``gemv_operands``), the accumulator's finish, and the row blocks.

Row blocks: a program of ``BLOCKS`` x 16 rows multiplies each decoded weight tile against every 16-row block in
turn, with the very dot the 16-row decode tile issues (same shape, warps and operand order), so a row gets the bits
of 16-row launches by construction while the packed bytes are read and decoded once for all of the program's rows.
Up to four blocks, each with its own accumulator; :func:`joined_rows` lays them side by side as the program's
``[BN, BLOCKS x 16]`` result."""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton
from dgpp.quant.kernels.fp4_tiles import fp4_step_scales, fp4_weights
from dgpp.quant.kernels.gemv_operands import (
    dot_scale,
    fp8_scale_tile,
    fp8_values,
    mma,
    next_step,
    per_row,
    w_tile,
    x_pairs,
    x_step_halves,
    x_tile,
)


@triton.jit
def fp8_step(
    acc,
    x_ptr,
    rows,
    m,
    x_stride,
    kk,
    k_hi,
    wv,
    s,
    FMT: tl.constexpr,
    W_AS_A: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One FP8 dot of one row block into its accumulator (block-scaled by ``s`` for FMT 0)."""
    part = mma(x_tile(x_ptr, rows, m, x_stride, kk, k_hi, EVEN, DOT_DTYPE), wv, W_AS_A, DOT_FP32)
    if FMT == 0:
        acc += per_row(part, s, W_AS_A)
    else:
        acc += part
    return acc


@triton.jit
def fp4_step(
    acc,
    x_ptr,
    rows,
    m,
    x_stride,
    k0,
    k_hi,
    lo,
    hi,
    ROWS: tl.constexpr,
    BK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    W_AS_A: tl.constexpr,
    EVEN: tl.constexpr,
    FP4_LAYOUT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    X_HALVES: tl.constexpr,
):
    """One FP4 K step of one row block into its accumulator: the even and odd columns' dots added in turn.
    ``X_HALVES``: x arrives in step order (``x_halves``), each half one contiguous load; otherwise the step's
    x is taken apart here."""
    HALF: tl.constexpr = BK // 2
    if X_HALVES:
        x_even, x_odd = x_step_halves(x_ptr, rows, m, x_stride, k0, HALF, DOT_DTYPE)
        acc += mma(x_even, lo, W_AS_A, DOT_FP32)
        acc += mma(x_odd, hi, W_AS_A, DOT_FP32)
    elif INTERLEAVE:  # one dot against contiguous x
        kk = k0 + tl.arange(0, BK)
        acc += mma(
            x_tile(x_ptr, rows, m, x_stride, kk, k_hi, EVEN, DOT_DTYPE),
            tl.interleave(lo, hi),
            W_AS_A,
            DOT_FP32,
        )
    elif FP4_LAYOUT == 1:  # x loaded as [ROWS, BK/2, 2] (pairs in one thread), split without a reshape
        x_even, x_odd = tl.split(x_pairs(x_ptr, rows, m, x_stride, k0, k_hi, ROWS, HALF, EVEN, DOT_DTYPE))
        acc += mma(x_even, lo, W_AS_A, DOT_FP32)
        acc += mma(x_odd, hi, W_AS_A, DOT_FP32)
    else:  # even and odd columns meet x split the same way (x read contiguously once)
        kk = k0 + tl.arange(0, BK)
        x_even, x_odd = tl.split(
            tl.reshape(x_tile(x_ptr, rows, m, x_stride, kk, k_hi, EVEN, DOT_DTYPE), (ROWS, HALF, 2))
        )
        acc += mma(x_even, lo, W_AS_A, DOT_FP32)
        acc += mma(x_odd, hi, W_AS_A, DOT_FP32)
    return acc


@triton.jit
def finish_block(
    acc,
    s_ptr,
    g_ptr,
    cols,
    col_ok,
    FMT: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    W_AS_A: tl.constexpr,
    EVEN: tl.constexpr,
    FAST_FP4: tl.constexpr,
):
    """A block's accumulator after the K loop: the per-channel or global scale, the fp16-nibble factor undone,
    oriented ``[BN, rows]``."""
    if FMT == 1:
        if EVEN:
            s = tl.load(s_ptr + cols)
        else:
            s = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
        acc = per_row(acc, s.to(tl.float32), W_AS_A)
    if FMT >= 2 and not FAST_FP4:
        acc = acc * 16384.0  # undo the 2^-14 of the fp16 nibble trick (exact)
    if GLOBAL_OP == 1:
        acc = acc * tl.load(g_ptr).to(tl.float32)
    elif GLOBAL_OP == 2:
        acc = acc / tl.load(g_ptr).to(tl.float32)
    if not W_AS_A:
        acc = tl.trans(acc)
    return acc


@triton.jit
def block_rows(block, ROWS: tl.constexpr):
    """The program-relative x rows of 16-row block ``block``."""
    return block * ROWS + tl.arange(0, ROWS)


@triton.jit
def joined_rows(acc0, acc1, acc2, acc3, BLOCKS: tl.constexpr):
    """``[BN, ROWS]`` accumulators of blocks 0..BLOCKS-1 -> ``[BN, BLOCKS x ROWS]``, block b in columns b x ROWS.."""
    if BLOCKS == 1:
        out = acc0
    elif BLOCKS == 2:
        pair = tl.permute(tl.join(acc0, acc1), (0, 2, 1))  # [BN, 2, ROWS]
        out = tl.reshape(pair, (acc0.shape[0], 2 * acc0.shape[1]))
    else:
        # join(join(a0, a1), join(a2, a3)) holds block lo + 2 hi at [n, r, lo, hi]
        quad = tl.permute(tl.join(tl.join(acc0, acc1), tl.join(acc2, acc3)), (0, 3, 2, 1))
        out = tl.reshape(quad, (acc0.shape[0], 4 * acc0.shape[1]))
    return out


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
    SCALES_AHEAD: tl.constexpr = False,
    X_HALVES: tl.constexpr = False,
):
    """``W[cols] @ x[:BM]^T`` as fp32 [BN, BM] for one packed weight (all scales applied). Each output's
    chain over K (the dots, their widths and order, where the scales enter) is fixed by the format, ``BK``,
    ``BKD`` and the K slice: never by ``BM``, so a row gets the same bits in a 16-row and a 64-row block.
    ``BLOCKS`` > 1: the BM rows run as BLOCKS blocks of BM / BLOCKS rows, each decoded weight tile meeting
    every block in the dot a BM / BLOCKS-row program issues (``row_blocks``).

    FP8: ``BKD`` logical columns per dot (divides ``SBK`` for block scales), ``BK // BKD`` dots per step.
    FP4: ``BK`` logical columns per step, ``SBK`` = group size. ``SCALES_AHEAD``: FP8 block and FP4 group
    scales are loaded one step before the step that uses them (carried through the loop), so their global
    latency overlaps a step's decode and dots; the values and the chain are unchanged. ``X_HALVES`` (FP4): x is
    in step order (``x_halves``, ``x_stride`` its row stride), the same values in the same dots."""
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
        s_next = 0.0
        if SCALES_AHEAD and FMT == 0:
            s_next = fp8_scale_tile(s_ptr, cols, col_ok, k_lo, k_hi, scale_cols, SBN, SBK, BK, BKD, EVEN)
        for k0 in range(k_lo, k_hi, BK):
            s_step = s_next
            if SCALES_AHEAD and FMT == 0:  # loaded during the previous step; load the next step's
                s_next = fp8_scale_tile(
                    s_ptr,
                    cols,
                    col_ok,
                    next_step(k0, k_hi, BK, EVEN),
                    k_hi,
                    scale_cols,
                    SBN,
                    SBK,
                    BK,
                    BKD,
                    EVEN,
                )
            for j in tl.static_range(BK // BKD):
                kd = k0 + j * BKD
                kk = kd + tl.arange(0, BKD)
                codes = w_tile(w_rows + kk[None, :], col_ok, kk < k_hi, EVEN)
                wv = fp8_values(codes, FP8_BITS, DOT_FP32, DOT_DTYPE)
                s = 1.0
                if FMT == 0 and SCALES_AHEAD:
                    s = dot_scale(s_step, j, BK // BKD)
                elif FMT == 0:
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
        s_rows = s_ptr + cols[:, None].to(tl.int64) * (k_dim // SBK)
        s_next = 0.0
        if SCALES_AHEAD:  # values, converted before they are carried (fewer sm_90 instructions than bytes)
            s_next = fp4_step_scales(
                s_rows, col_ok, k_lo, k_hi, FMT, SBK, BN, BK, EVEN, FP4_LAYOUT, FP4_SCALES, DOT_DTYPE
            )
        for k0 in range(k_lo, k_hi, BK):
            s_step = s_next
            if SCALES_AHEAD:  # this step's scales were loaded during the previous step; load the next step's
                k_next = next_step(k0, k_hi, BK, EVEN)
                s_next = fp4_step_scales(
                    s_rows, col_ok, k_next, k_hi, FMT, SBK, BN, BK, EVEN, FP4_LAYOUT, FP4_SCALES, DOT_DTYPE
                )
            lo, hi = fp4_weights(
                w_rows,
                s_rows,
                s_step,
                col_ok,
                k0,
                k_hi,
                SCALES_AHEAD,
                FMT,
                SBK,
                BN,
                BK,
                EVEN,
                FAST_FP4,
                FP4_LAYOUT,
                FP4_SCALES,
                DOT_DTYPE,
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
                X_HALVES,
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
                    X_HALVES,
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
                    X_HALVES,
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
                    X_HALVES,
                )
    acc0 = finish_block(acc0, s_ptr, g_ptr, cols, col_ok, FMT, GLOBAL_OP, W_AS_A, EVEN, FAST_FP4)
    if BLOCKS > 1:
        acc1 = finish_block(acc1, s_ptr, g_ptr, cols, col_ok, FMT, GLOBAL_OP, W_AS_A, EVEN, FAST_FP4)
    if BLOCKS > 2:
        acc2 = finish_block(acc2, s_ptr, g_ptr, cols, col_ok, FMT, GLOBAL_OP, W_AS_A, EVEN, FAST_FP4)
        acc3 = finish_block(acc3, s_ptr, g_ptr, cols, col_ok, FMT, GLOBAL_OP, W_AS_A, EVEN, FAST_FP4)
    return joined_rows(acc0, acc1, acc2, acc3, BLOCKS)
