"""A packed expert weight tile as the grouped expert GEMM's dot operand (``dgpp.quant.kernels.moe_gemm``): one
stack's scales and zeros for a K step, and sub-position ``i`` of its stored [BN, BKP] tile decoded.

E2M1 with E4M3 / E8M0 group scales and bf16 activations (``FP4_EXACT``) multiplies code and scale exactly in bf16,
the scale bytes loaded one K step ahead; int4 with bf16 scales (``INT4_BF16``) multiplies the exact ``code - 8`` by
its scale, rounded once; every other format takes the weight-only linear's decode (``wo_matmul``), rounded to the
activation dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dgpp.quant.kernels.e2m1_asm import e2m1_pairs
from dgpp.quant.kernels.int4_asm import int4_centred
from dgpp.quant.kernels.wo_matmul import _decode, _e2m1_value, _e8m0_value, _scales


@triton.jit
def fp4_exact_weights(stored, i, scales, FAST_E2M1: tl.constexpr, DOT_LOW: tl.constexpr):
    """Sub-position ``i`` of a [BN, BKP] tile of E2M1 pairs times its group ``scales`` (fp32 [BN, BKP]), exact:
    in bf16 for the tensor cores, in fp32 where the dot runs in fp32 (the interpreter) - the same values."""
    if FAST_E2M1:
        lo, hi = e2m1_pairs(stored, tl.bfloat16)
        if i == 0:
            code = lo
        else:
            code = hi
    else:
        code = _e2m1_value((stored.to(tl.int32) >> (4 * i)) & 0xF)
    if DOT_LOW:
        w = code.to(tl.bfloat16) * scales.to(tl.bfloat16)
    else:
        w = code.to(tl.float32) * scales
    return w


@triton.jit
def group_scale_bytes(
    s_base, offs_n, n_ok, kp0, kp_hi, stride_sn, stride_sk, GSP: tl.constexpr, BKP: tl.constexpr
):
    """The stored E4M3 / E8M0 scale bytes of a [BN, BKP] tile of E2M1 pairs: [BN, BKP / GSP], one per group of
    GSP stored bytes (zero past ``kp_hi``)."""
    offs_g = kp0 // GSP + tl.arange(0, BKP // GSP)
    return tl.load(
        s_base + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk,
        mask=n_ok[:, None] & (offs_g * GSP < kp_hi)[None, :],
        other=0,
    )


@triton.jit
def scale_per_weight(raw, SCALE_E8M0: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr, GSP: tl.constexpr):
    """Scale bytes [BN, BKP / GSP] -> fp32 scales [BN, BKP], one per stored byte."""
    if SCALE_E8M0:
        sf = _e8m0_value(raw)
    else:
        sf = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.reshape(tl.broadcast_to(sf[:, :, None], (BN, BKP // GSP, GSP)), (BN, BKP))


@triton.jit
def step_scales(
    carried,
    s_base,
    z_base,
    offs_n,
    n_ok,
    kp0,
    KP,
    stride_sn,
    stride_sk,
    stride_zk,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    PACK: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    BN: tl.constexpr,
    BKP: tl.constexpr,
    FP4_EXACT: tl.constexpr,
):
    """One stack's scales and zeros for the K step at ``kp0``, and what it carries to the next step: with
    ``FP4_EXACT`` the scale bytes loaded a step ahead (``carried``) spread per weight, and the next step's loaded
    now; else ``_scales`` of this step, and ``carried`` unchanged."""
    if FP4_EXACT:
        GSP: tl.constexpr = SBK // PACK
        scales = scale_per_weight(carried, SCALE_E8M0, BN, BKP, GSP)
        zeros = tl.zeros((BN,), dtype=tl.int32)
        ahead = group_scale_bytes(s_base, offs_n, n_ok, kp0 + BKP, KP, stride_sn, stride_sk, GSP, BKP)
    else:
        scales, zeros = _scales(
            s_base,
            z_base,
            offs_n,
            n_ok,
            kp0,
            KP,
            stride_sn,
            stride_sk,
            stride_zk,
            FMT,
            BITS,
            SCALE_E8M0,
            ZERO_OFFSET,
            SCALE_MODE,
            PACK,
            SBN,
            SBK,
            BN,
            BKP,
        )
        ahead = carried
    return scales, zeros, ahead


@triton.jit
def weight_operand(
    stored,
    i,
    offs_n,
    offs_k,
    kp_ok,
    tile_ok,
    s_base,
    z_base,
    g,
    scales,
    zeros,
    stride_sn,
    stride_sk,
    stride_zk,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    FAST_E2M1: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    DOT_LOW: tl.constexpr,
    FP4_EXACT: tl.constexpr,
    INT4_BF16: tl.constexpr,
):
    """Sub-position ``i`` of one stack's stored tile as the dot's weight operand: E2M1 times its scale exact
    (``FP4_EXACT``), int4 ``code - 8`` times its bf16 scale rounded once (``INT4_BF16``), else the weight-only
    decode rounded to the activation dtype."""
    if FP4_EXACT:
        w = fp4_exact_weights(stored, i, scales, FAST_E2M1, DOT_LOW)
    elif INT4_BF16:  # bf16 x bf16 (the scales widened from bf16): the exact product rounded once
        w = int4_centred(stored, i) * scales.to(tl.bfloat16)
    else:
        w = _decode(
            stored,
            i,
            offs_n,
            offs_k,
            kp_ok,
            tile_ok,
            s_base,
            z_base,
            s_base,
            g,
            scales,
            zeros,
            stride_sn,
            stride_sk,
            stride_zk,
            FMT,
            BITS,
            SCALE_E8M0,
            GLOBAL_OP,
            ZERO_OFFSET,
            False,
            SCALE_MODE,
            SBN,
            SBK,
            FAST_E2M1,
            ROUND_DTYPE,
        ).to(ROUND_DTYPE)
    return w
