"""Decode GEMV kernels for packed FP8 and FP4 weights (``M <= 16`` rows), modelled on ``dgpp.kernels.gemv``.

Each program owns ``BN`` output rows of one weight and walks the whole ``K`` (no split, so the sum order
is fixed): x rows are padded to ``BM = 16`` and every step is a tensor-core ``tl.dot`` in the activation
dtype. Rows never mix inside an MMA, so a row's result is the same bits whatever the batch (MTP verify
relies on it). The packed bytes are read once and decoded in registers:

* FP8 E4M3 (``FMT_FP8_BLOCK``): codes upcast to the dot dtype (exact), one dot per scale block along K,
  the fp32 partial multiplied by that block's scale. Per-channel (``FMT_FP8_CHANNEL``): one scale per
  output row, applied once after the K loop.
* E2M1 pairs (``FMT_FP4_E4M3`` NVFP4, ``FMT_FP4_E8M0`` MXFP4): a nibble's three magnitude bits shifted
  into an fp16's exponent/mantissa (``mag << 9``) and its sign into bit 15 give exactly e2m1 × 2^-14 (the
  subnormal 0.5 included): 4 integer ops and one convert per weight. The group scale multiplies in the
  dot dtype (e2m1 × E4M3 and e2m1 × 2^e are exact in bf16); 2^14 and the per-tensor global scale are
  applied to the fp32 accumulator after the loop. Low nibbles (even columns) and high nibbles (odd
  columns) either meet x read at stride 2 in two dots, or are interleaved (``INTERLEAVE``) for one dot
  against contiguous x.

``DOT_FP32`` (fp32 activations, and the Triton interpreter whose bf16 is wrong) decodes and multiplies
in fp32 with IEEE dots instead.
"""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton

FMT_FP8_BLOCK = 0
FMT_FP8_CHANNEL = 1
FMT_FP4_E4M3 = 2
FMT_FP4_E8M0 = 3

GLOBAL_NONE = 0
GLOBAL_MUL = 1
GLOBAL_DIV = 2

BM = 16  # x rows per MMA: decode batches of 1..16 share one padded tile


@triton.jit
def _x_tile(x_ptr, rows, m, x_stride, kk, k_dim, DOT_DTYPE: tl.constexpr):
    xv = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=(rows[:, None] < m) & (kk < k_dim)[None, :],
                 other=0.0)
    return xv.to(DOT_DTYPE)


@triton.jit
def _dot(a, b_t, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a, tl.trans(b_t), input_precision="ieee")
    return tl.dot(a, tl.trans(b_t))


@triton.jit
def _e2m1_scaled(nib, DOT_DTYPE: tl.constexpr):
    """4-bit E2M1 codes (int16, 0..15) -> value × 2^-14 in ``DOT_DTYPE``, exactly, via fp16 bits."""
    bits = ((nib & 0x7) << 9) | ((nib & 0x8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(DOT_DTYPE)


@triton.jit
def _fp4_group_scales(s_ptr, cols, col_ok, kg0, groups, GPS: tl.constexpr, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The ``GPS`` group scales of each row in one step, decoded to ``DOT_DTYPE`` ([BN, GPS])."""
    offs_g = kg0 + tl.arange(0, GPS)
    s = tl.load(s_ptr + cols[:, None].to(tl.int64) * groups + offs_g[None, :],
                mask=col_ok[:, None] & (offs_g < groups)[None, :], other=0)
    if FMT == 3:  # E8M0: 2^(s-127) built as fp32 bits; s == 0 is 2^-127, an fp32 subnormal
        s32 = s.to(tl.int32)
        sf = tl.where(s32 == 0, 5.877471754111438e-39, (s32 << 23).to(tl.float32, bitcast=True))
    else:
        sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return sf.to(DOT_DTYPE)


@triton.jit
def _spread(sf, BN: tl.constexpr, GPS: tl.constexpr, PER: tl.constexpr):
    """[BN, GPS] group scales -> [BN, GPS * PER], each repeated over its PER columns."""
    return tl.reshape(tl.broadcast_to(sf[:, :, None], (BN, GPS, PER)), (BN, GPS * PER))


@triton.jit
def quant_tile(x_ptr, w_ptr, s_ptr, g_ptr, m, k_dim, n_rows, x_stride, cols,
               FMT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, GLOBAL_OP: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr, INTERLEAVE: tl.constexpr,
               DOT_FP32: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """``x[:16] @ W[cols]^T`` as fp32 [BM, BN] for one packed weight (all scales applied).

    FP8: ``BKD`` logical columns per dot (divides ``SBK`` for block scales), ``BK // BKD`` dots per step.
    FP4: ``BK`` logical columns per step, ``SBK`` = group size."""
    rows = tl.arange(0, BM)
    col_ok = cols < n_rows
    acc = tl.zeros([BM, BN], tl.float32)
    if FMT <= 1:
        w_rows = w_ptr + cols[:, None].to(tl.int64) * k_dim
        scale_cols = tl.cdiv(k_dim, SBK)
        for k0 in range(0, k_dim, BK):
            for j in tl.static_range(BK // BKD):
                kd = k0 + j * BKD
                kk = kd + tl.arange(0, BKD)
                xv = _x_tile(x_ptr, rows, m, x_stride, kk, k_dim, DOT_DTYPE)
                codes = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & (kk < k_dim)[None, :], other=0)
                wv = codes.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
                part = _dot(xv, wv, DOT_FP32)
                if FMT == 0:
                    s = tl.load(s_ptr + (cols // SBN) * scale_cols + kd // SBK, mask=col_ok & (kd < k_dim), other=0.0)
                    acc += part * s.to(tl.float32)[None, :]
                else:
                    acc += part
        if FMT == 1:
            acc = acc * tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    else:
        HALF: tl.constexpr = BK // 2
        GPS: tl.constexpr = BK // SBK  # groups per step
        w_rows = w_ptr + cols[:, None].to(tl.int64) * (k_dim // 2)
        groups = k_dim // SBK
        for k0 in range(0, k_dim, BK):
            kp = k0 // 2 + tl.arange(0, HALF)
            packed = tl.load(w_rows + kp[None, :], mask=col_ok[:, None] & (kp < k_dim // 2)[None, :], other=0)
            b = packed.to(tl.int16)
            sf = _fp4_group_scales(s_ptr, cols, col_ok, k0 // SBK, groups, GPS, FMT, DOT_DTYPE)
            if INTERLEAVE:
                wv = tl.interleave(_e2m1_scaled(b & 0xF, DOT_DTYPE), _e2m1_scaled(b >> 4, DOT_DTYPE))
                wv = wv * _spread(sf, BN, GPS, SBK)
                kk = k0 + tl.arange(0, BK)
                acc += _dot(_x_tile(x_ptr, rows, m, x_stride, kk, k_dim, DOT_DTYPE), wv, DOT_FP32)
            else:
                spread = _spread(sf, BN, GPS, SBK // 2)
                lo = _e2m1_scaled(b & 0xF, DOT_DTYPE) * spread
                hi = _e2m1_scaled(b >> 4, DOT_DTYPE) * spread
                even = k0 + 2 * tl.arange(0, HALF)
                acc += _dot(_x_tile(x_ptr, rows, m, x_stride, even, k_dim, DOT_DTYPE), lo, DOT_FP32)
                acc += _dot(_x_tile(x_ptr, rows, m, x_stride, even + 1, k_dim, DOT_DTYPE), hi, DOT_FP32)
        acc = acc * 16384.0  # undo the 2^-14 of the fp16 nibble trick (exact)
    if GLOBAL_OP == 1:
        acc = acc * tl.load(g_ptr).to(tl.float32)
    elif GLOBAL_OP == 2:
        acc = acc / tl.load(g_ptr).to(tl.float32)
    return acc


@triton.jit
def quant_multi_gemv_kernel(
    x_ptr, w0, s0, g0, w1, s1, g1, w2, s2, g2, out_ptr, m, k_dim, n0, n1, n2, x_stride, out_stride,
    FMT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, GLOBAL_OP: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr, INTERLEAVE: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Up to three weights of one format side by side (q/k/v): the program id picks the weight; segment
    starts are BN-aligned so a program never straddles two weights. Output columns are the concatenation."""
    start = tl.program_id(0) * BN
    w_ptr, s_ptr, g_ptr, local, n_rows = w0, s0, g0, start, n0
    seg1 = tl.cdiv(n0, BN) * BN
    seg2 = seg1 + tl.cdiv(n1, BN) * BN
    out_base = 0
    if start >= seg2:
        w_ptr, s_ptr, g_ptr, local, n_rows, out_base = w2, s2, g2, start - seg2, n2, n0 + n1
    elif start >= seg1:
        w_ptr, s_ptr, g_ptr, local, n_rows, out_base = w1, s1, g1, start - seg1, n1, n0
    cols = local + tl.arange(0, BN)
    acc = quant_tile(x_ptr, w_ptr, s_ptr, g_ptr, m, k_dim, n_rows, x_stride, cols, FMT, SBN, SBK, GLOBAL_OP,
                     BN, BK, BKD, INTERLEAVE, DOT_FP32, DOT_DTYPE)
    rows = tl.arange(0, BM)
    tl.store(out_ptr + rows[:, None] * out_stride + (out_base + cols)[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < m) & (cols < n_rows)[None, :])


@triton.jit
def quant_gate_up_silu_kernel(
    x_ptr, wg, sg, gg, wu, su, gu, out_ptr, m, k_dim, n_rows, x_stride, out_stride,
    FMT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, GLOBAL_OP: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr, INTERLEAVE: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """``silu(x wg^T) * (x wu^T)`` for BN intermediate columns; gate and up rounded to the output dtype
    first, as the eager layer's activations are."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    gate = quant_tile(x_ptr, wg, sg, gg, m, k_dim, n_rows, x_stride, cols, FMT, SBN, SBK, GLOBAL_OP,
                      BN, BK, BKD, INTERLEAVE, DOT_FP32, DOT_DTYPE)
    up = quant_tile(x_ptr, wu, su, gu, m, k_dim, n_rows, x_stride, cols, FMT, SBN, SBK, GLOBAL_OP,
                    BN, BK, BKD, INTERLEAVE, DOT_FP32, DOT_DTYPE)
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    rows = tl.arange(0, BM)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < m) & (cols < n_rows)[None, :])
