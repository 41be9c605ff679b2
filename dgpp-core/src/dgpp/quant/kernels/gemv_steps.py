"""The packed MMA GEMV's tile (``quant_tile``, which ``decode_gemv``'s kernels launch) and its steps: x tiles, one
dot in either operand order, the per-block FP8 and FP4 steps, the accumulator's finish, and the row blocks.

Row blocks: a program of ``BLOCKS`` x 16 rows multiplies each decoded weight tile against every 16-row block in
turn, with the very dot the 16-row decode tile issues (same shape, warps and operand order), so a row gets the bits
of 16-row launches by construction while the packed bytes are read and decoded once for all of the program's rows.
Up to four blocks, each with its own accumulator; :func:`joined_rows` lays them side by side as the program's
``[BN, BLOCKS x 16]`` result."""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton
from dgpp.quant.kernels.e4m3_asm import e4m3_fp32, e4m3_values
from dgpp.quant.kernels.fp4_tiles import fp4_flat_weights, fp4_grouped_weights


@triton.jit
def _x_tile(x_ptr, rows, m, x_stride, kk, k_dim, EVEN: tl.constexpr, DOT_DTYPE: tl.constexpr):
    mask = rows[:, None] < m
    if not EVEN:
        mask = mask & (kk < k_dim)[None, :]
    return tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def _x_pairs(
    x_ptr,
    rows,
    m,
    x_stride,
    k0,
    k_dim,
    BM: tl.constexpr,
    HALF: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """x[:, k0 : k0 + 2 HALF] as [BM, HALF, 2] column pairs (the pair contiguous, so ``tl.split`` stays in registers)."""
    kk = k0 + 2 * tl.arange(0, HALF)[None, :, None] + tl.arange(0, 2)[None, None, :]
    mask = rows[:, None, None] < m
    if not EVEN:
        mask = mask & (kk < k_dim)
    return tl.load(x_ptr + rows[:, None, None] * x_stride + kk, mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def w_tile(ptrs, col_ok, k_ok, EVEN: tl.constexpr):
    """Stored bytes of a weight tile; ``EVEN`` (every N a multiple of BN, K of BK) drops the masks."""
    if EVEN:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0)
    return tile


@triton.jit
def _mma(xv, wv, W_AS_A: tl.constexpr, DOT_FP32: tl.constexpr):
    """One step's partial in the accumulator's orientation: ``w @ x^T`` [BN, BM] when the weight is the
    MMA's A operand (each warp then owns whole 16-row weight slices and x is re-read less), else ``x @ w^T``."""
    if W_AS_A:
        a, b = wv, tl.trans(xv)
    else:
        a, b = xv, tl.trans(wv)
    if DOT_FP32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def fp8_values(codes, FP8_BITS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """E4M3 codes -> exact values in the dot dtype: Triton's conversion (the cvt pipe), or ``FP8_BITS``
    integer bit placement (inline PTX on the GPU, fp32 bit ops for fp32 dots)."""
    if FP8_BITS:
        if DOT_FP32:
            out = e4m3_fp32(codes)
        else:
            out = e4m3_values(codes, DOT_DTYPE)
    else:
        out = codes.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    return out


@triton.jit
def _per_row(acc, s, W_AS_A: tl.constexpr):
    """``acc`` scaled by one fp32 value per weight row (``s`` [BN])."""
    if W_AS_A:
        out = acc * s[:, None]
    else:
        out = acc * s[None, :]
    return out


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
    part = _mma(_x_tile(x_ptr, rows, m, x_stride, kk, k_hi, EVEN, DOT_DTYPE), wv, W_AS_A, DOT_FP32)
    if FMT == 0:
        acc += _per_row(part, s, W_AS_A)
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
):
    """One FP4 K step of one row block into its accumulator: the even and odd columns' dots added in turn."""
    HALF: tl.constexpr = BK // 2
    if INTERLEAVE:  # one dot against contiguous x
        kk = k0 + tl.arange(0, BK)
        acc += _mma(
            _x_tile(x_ptr, rows, m, x_stride, kk, k_hi, EVEN, DOT_DTYPE),
            tl.interleave(lo, hi),
            W_AS_A,
            DOT_FP32,
        )
    elif FP4_LAYOUT == 1:  # x loaded as [ROWS, BK/2, 2] (pairs in one thread), split without a reshape
        x_even, x_odd = tl.split(_x_pairs(x_ptr, rows, m, x_stride, k0, k_hi, ROWS, HALF, EVEN, DOT_DTYPE))
        acc += _mma(x_even, lo, W_AS_A, DOT_FP32)
        acc += _mma(x_odd, hi, W_AS_A, DOT_FP32)
    else:  # even and odd columns meet x split the same way (x read contiguously once)
        kk = k0 + tl.arange(0, BK)
        x_even, x_odd = tl.split(
            tl.reshape(_x_tile(x_ptr, rows, m, x_stride, kk, k_hi, EVEN, DOT_DTYPE), (ROWS, HALF, 2))
        )
        acc += _mma(x_even, lo, W_AS_A, DOT_FP32)
        acc += _mma(x_odd, hi, W_AS_A, DOT_FP32)
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
        acc = _per_row(acc, s.to(tl.float32), W_AS_A)
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
