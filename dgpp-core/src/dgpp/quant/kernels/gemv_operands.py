"""Operands of the packed MMA GEMV's steps (``gemv_steps``): x tiles (contiguous, as even/odd column pairs, or
the even and odd halves of a step from x written in step order by ``x_halves``),
the stored weight bytes of a tile, E4M3 codes as dot values, one dot in either operand order, per-row scaling, the
FP8 block scales of a step, and where the next step starts for loads issued a step ahead."""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton
from dgpp.quant.kernels.e4m3_asm import e4m3_fp32, e4m3_values


@triton.jit
def x_tile(x_ptr, rows, m, x_stride, kk, k_dim, EVEN: tl.constexpr, DOT_DTYPE: tl.constexpr):
    mask = rows[:, None] < m
    if not EVEN:
        mask = mask & (kk < k_dim)[None, :]
    return tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def x_pairs(
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
def x_step_halves(x_ptr, rows, m, x_stride, k0, HALF: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The step at ``k0`` of x in step order (``x_halves``: its even columns at k0.., its odd ones at k0 + HALF..)
    as two contiguous [rows, HALF] tiles. The pre-pass padded K to whole steps with zeros: no K mask."""
    ptrs = x_ptr + rows[:, None] * x_stride + k0 + tl.arange(0, HALF)[None, :]
    mask = rows[:, None] < m
    x_even = tl.load(ptrs, mask=mask, other=0.0).to(DOT_DTYPE)
    x_odd = tl.load(ptrs + HALF, mask=mask, other=0.0).to(DOT_DTYPE)
    return x_even, x_odd


@triton.jit
def w_tile(ptrs, col_ok, k_ok, EVEN: tl.constexpr):
    """Stored bytes of a weight tile; ``EVEN`` (every N a multiple of BN, K of BK) drops the masks."""
    if EVEN:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0)
    return tile


@triton.jit
def mma(xv, wv, W_AS_A: tl.constexpr, DOT_FP32: tl.constexpr):
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
def per_row(acc, s, W_AS_A: tl.constexpr):
    """``acc`` scaled by one fp32 value per weight row (``s`` [BN])."""
    if W_AS_A:
        out = acc * s[:, None]
    else:
        out = acc * s[None, :]
    return out


@triton.jit
def fp8_scale_tile(
    s_ptr,
    cols,
    col_ok,
    k0,
    k_hi,
    scale_cols,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    BK: tl.constexpr,
    BKD: tl.constexpr,
    EVEN: tl.constexpr,
):
    """The block scales (fp32) of the step at ``k0``'s BK // BKD dots, [BN, BK // BKD]: column j is the scale of
    the dot over columns k0 + j BKD.."""
    kd = k0 + tl.arange(0, BK // BKD) * BKD
    ptrs = s_ptr + (cols // SBN)[:, None] * scale_cols + (kd // SBK)[None, :]
    if EVEN:
        s = tl.load(ptrs)
    else:
        s = tl.load(ptrs, mask=col_ok[:, None] & (kd < k_hi)[None, :], other=0.0)
    return s.to(tl.float32)


@triton.jit
def dot_scale(s_step, j: tl.constexpr, DOTS: tl.constexpr):
    """Column ``j`` of a step's [BN, DOTS] scales (exact: the other columns enter as zeros)."""
    pick = tl.arange(0, DOTS)[None, :] == j
    return tl.sum(tl.where(pick, s_step, 0.0), axis=1)


@triton.jit
def next_step(k0, k_hi, BK: tl.constexpr, EVEN: tl.constexpr):
    """Where the step after ``k0`` starts, for loads issued a step ahead: past the slice the masks (not
    ``EVEN``) drop them; with ``EVEN`` (no masks) the last step's start, re-read instead of read past the end."""
    if EVEN:
        out = tl.minimum(k0 + BK, k_hi - BK)
    else:
        out = k0 + BK
    return out
