"""One Triton weight-only GEMM/GEMV that reads the packed bytes of every integer/float format as shipped.

``out[M, N] = x[M, K] @ W^T`` where W's [BN, BK] tiles are decoded in registers. A stored element holds
PACK consecutive weights along K (1 for FP8, 2 for E2M1 pairs, 32/bits for int32 words); the kernel
walks a tile of stored elements and issues one dot per sub-position, with x read at stride PACK, so the
packed bytes are never expanded in memory. Decoded values are rounded to ROUND_DTYPE (the activation
dtype) exactly like the torch reference decode, then the dot runs in that dtype (DOT_LOW, tensor cores)
or in fp32 (the interpreter, whose bf16 is broken, and fp32 activations). Split-K writes fp32 partials
that the caller sums in a fixed order, so results do not depend on scheduling.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dgpp.quant.kernels.e2m1_asm import e2m1_pairs

FMT_FP8 = (
    0  # E4M3 bytes [N, K] (passed as uint8 so masked loads can fill 0), F32/BF16 scale per (SBN x SBK) tile
)
FMT_FP4 = 1  # E2M1 pairs [N, K/2], E4M3 or E8M0 scale per SBK columns, optional global mul/div
FMT_INT = 2  # codes in int32 words along K [N, K*b/32], scale per SBK columns, fixed zero ZERO_OFFSET
FMT_GPTQ = 3  # codes in int32 words along K, transposed [K*b/32, N]; packed zeros and F16 scales per group


@triton.jit
def _e2m1_value(nib):
    """E2M1 code -> fp32 by building the fp32 bits (integer ops only): 0.5·m for e == 0, else (1 + m/2)·2^(e−1)."""
    e = (nib >> 1) & 3
    m = nib & 1
    exp_field = tl.where(e == 0, m * 126, e + 126)
    mant = tl.where(e == 0, 0, m << 22)
    bits = ((nib >> 3) << 31) | (exp_field << 23) | mant
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def code_f32(code, offset):
    """``code - offset`` as fp32 for codes 0 <= code < 2^23, without the int->float conversion pipe (16 per
    clock per SM): OR-ing the code into the mantissa of 2^23 gives 2^23 + code exactly, and the subtraction
    of the integer 2^23 + offset is exact too."""
    return (code.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _e8m0_value(s):
    s32 = s.to(tl.int32)
    v = (s32 << 23).to(tl.float32, bitcast=True)
    return tl.where(s32 == 0, 5.877471754111438e-39, v)


@triton.jit
def _tile_scales(
    s_ptr,
    z_ptr,
    offs_n,
    n_ok,
    k_first,
    stride_sn,
    stride_sk,
    stride_zk,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
):
    """Scale (and zero) per output row for a K tile that lies inside one scale block (ROWWISE)."""
    col = k_first // SBK
    if FMT == 0:
        s = tl.load(s_ptr + (offs_n // SBN) * stride_sn + col * stride_sk, mask=n_ok, other=0.0).to(
            tl.float32
        )
        z = tl.zeros_like(offs_n)
    elif FMT == 2:
        s = tl.load(s_ptr + offs_n * stride_sn + col * stride_sk, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.zeros_like(offs_n) + ZERO_OFFSET
    else:
        per_word: tl.constexpr = 32 // BITS
        s = tl.load(s_ptr + col * stride_sk + offs_n * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
        zw = tl.load(z_ptr + col * stride_zk + offs_n // per_word, mask=n_ok, other=0)
        z = ((zw >> ((offs_n % per_word) * BITS)) & ((1 << BITS) - 1)) + ZERO_OFFSET
    return s, z


@triton.jit
def _group_scales(
    s_ptr,
    offs_n,
    n_ok,
    kp0,
    kp_hi,
    stride_sn,
    stride_sk,
    FMT: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    BN: tl.constexpr,
    BKP: tl.constexpr,
    GS: tl.constexpr,
):
    """Scales of a [BN, BKP] tile whose groups span GS stored elements: one load per group, decoded once,
    then broadcast over the group (instead of one gather per weight)."""
    offs_g = kp0 // GS + tl.arange(0, BKP // GS)
    s = tl.load(
        s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk,
        mask=n_ok[:, None] & (offs_g * GS < kp_hi)[None, :],
        other=0,
    )
    if FMT == 1:
        if SCALE_E8M0:
            sf = _e8m0_value(s)
        else:
            sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        sf = s.to(tl.float32)
    return tl.reshape(tl.broadcast_to(sf[:, :, None], (BN, BKP // GS, GS)), (BN, BKP))


@triton.jit
def _scales(
    s_ptr,
    z_ptr,
    offs_n,
    n_ok,
    kp0,
    kp_hi,
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
):
    """Scales (and zeros) loaded once for a K tile: per row (mode 1), per group broadcast (mode 2), or
    nothing here (mode 0: ``_decode`` gathers them per weight)."""
    if SCALE_MODE == 1:
        s_pre, z_row = _tile_scales(
            s_ptr,
            z_ptr,
            offs_n,
            n_ok,
            kp0 * PACK,
            stride_sn,
            stride_sk,
            stride_zk,
            FMT,
            BITS,
            ZERO_OFFSET,
            SBN,
            SBK,
        )
    elif SCALE_MODE == 2:
        s_pre = _group_scales(
            s_ptr, offs_n, n_ok, kp0, kp_hi, stride_sn, stride_sk, FMT, SCALE_E8M0, BN, BKP, SBK // PACK
        )
        z_row = tl.zeros((BN,), dtype=tl.int32)
    else:
        s_pre = tl.zeros((BN,), dtype=tl.float32)
        z_row = tl.zeros((BN,), dtype=tl.int32)
    return s_pre, z_row


@triton.jit
def _decode(
    stored,
    i,
    offs_n,
    offs_k,
    kp_ok,
    tile_ok,
    s_ptr,
    z_ptr,
    gidx_ptr,
    g,
    s_pre,
    z_row,
    stride_sn,
    stride_sk,
    stride_zk,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    FAST_E2M1: tl.constexpr = False,
    ROUND_DTYPE: tl.constexpr = tl.bfloat16,
):
    """Sub-position ``i`` of a stored [BN, BKP] tile -> fp32 weights [BN, BKP] (before the final rounding).
    ``s_pre``: per-row scales [BN] (SCALE_MODE 1) or the tile's scales [BN, BKP] (SCALE_MODE 2).
    ``FAST_E2M1`` (GPU, >= 4 bytes per thread): E2M1 pairs through the inline-PTX byte-permute decoder
    (exact bf16/fp16 values, ~1.25 instructions per weight; the pure CSE shares it between both ``i``)
    instead of building fp32 bits per nibble (~10 integer ops)."""
    code_mask: tl.constexpr = (1 << BITS) - 1
    if FMT == 0:
        if SCALE_MODE == 1:
            sf = s_pre[:, None]
        else:
            sf = tl.load(
                s_ptr + (offs_n // SBN)[:, None] * stride_sn + (offs_k // SBK)[None, :] * stride_sk,
                mask=tile_ok,
                other=0.0,
            ).to(tl.float32)
        w = stored.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sf
    elif FMT == 1:
        if FAST_E2M1:
            lo, hi = e2m1_pairs(stored, ROUND_DTYPE)
            if i == 0:
                e2m1 = lo.to(tl.float32)
            else:
                e2m1 = hi.to(tl.float32)
        else:
            e2m1 = _e2m1_value((stored.to(tl.int32) >> (4 * i)) & 0xF)
        if SCALE_MODE == 2:
            sf = s_pre
        else:
            s = tl.load(
                s_ptr + offs_n[:, None] * stride_sn + (offs_k // SBK)[None, :] * stride_sk,
                mask=tile_ok,
                other=0,
            )
            if SCALE_E8M0:
                sf = _e8m0_value(s)
            else:
                sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w = e2m1 * sf
        if GLOBAL_OP == 1:
            w = w * g
        elif GLOBAL_OP == 2:
            w = w / g
    elif FMT == 2:
        code = (stored >> (BITS * i)) & code_mask
        if SCALE_MODE == 1:
            w = code_f32(code, ZERO_OFFSET) * s_pre[:, None]
        elif SCALE_MODE == 2:
            w = code_f32(code, ZERO_OFFSET) * s_pre
        else:
            s = tl.load(
                s_ptr + offs_n[:, None] * stride_sn + (offs_k // SBK)[None, :] * stride_sk,
                mask=tile_ok,
                other=0.0,
            )
            w = code_f32(code, ZERO_OFFSET) * s.to(tl.float32)
    else:
        code = (stored >> (BITS * i)) & code_mask
        if SCALE_MODE == 1:
            w = (code - z_row[:, None]).to(tl.float32) * s_pre[:, None]
        else:
            per_word: tl.constexpr = 32 // BITS
            if HAS_GIDX:
                grp = tl.load(gidx_ptr + offs_k, mask=kp_ok, other=0)
            else:
                grp = offs_k // SBK
            s = tl.load(
                s_ptr + grp[None, :] * stride_sk + offs_n[:, None] * stride_sn, mask=tile_ok, other=0.0
            )
            zw = tl.load(
                z_ptr + grp[None, :] * stride_zk + (offs_n // per_word)[:, None], mask=tile_ok, other=0
            )
            zero = ((zw >> ((offs_n % per_word) * BITS)[:, None]) & code_mask) + ZERO_OFFSET
            w = (code - zero).to(tl.float32) * s.to(tl.float32)
    return w


@triton.jit
def wo_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    gidx_ptr,
    out_ptr,
    M,
    N,
    KP,
    stride_xm,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_zk,
    stride_om,
    stride_os,
    kp_per_split,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    FMT: tl.constexpr,
    PACK: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    DOT_LOW: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKP: tl.constexpr,
):
    """BM == 1 is the decode GEMV: one x row per program (grid dim 0 = rows), fp32 multiply-and-sum, so a
    row's result does not depend on how many rows share the launch. BM >= 16 uses tensor-core dots."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    kp_lo = pid_s * kp_per_split
    kp_hi = tl.minimum(kp_lo + kp_per_split, KP)
    g = 1.0
    if GLOBAL_OP != 0:
        g = tl.load(g_ptr).to(tl.float32)
    if BM == 1:
        acc = tl.zeros((BN, BKP), dtype=tl.float32)  # reduced over K once, after the loop
    else:
        offs_m = pid_m * BM + tl.arange(0, BM)
        m_ok = offs_m < M
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kp0 in range(kp_lo, kp_hi, BKP):
        offs_kp = kp0 + tl.arange(0, BKP)
        kp_ok = offs_kp < kp_hi
        tile_ok = n_ok[:, None] & kp_ok[None, :]
        stored = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_kp[None, :] * stride_wk, mask=tile_ok, other=0
        )
        s_pre, z_row = _scales(
            s_ptr,
            z_ptr,
            offs_n,
            n_ok,
            kp0,
            kp_hi,
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
        for i in tl.static_range(PACK):
            offs_k = offs_kp * PACK + i
            w = _decode(
                stored,
                i,
                offs_n,
                offs_k,
                kp_ok,
                tile_ok,
                s_ptr,
                z_ptr,
                gidx_ptr,
                g,
                s_pre,
                z_row,
                stride_sn,
                stride_sk,
                stride_zk,
                FMT,
                BITS,
                SCALE_E8M0,
                GLOBAL_OP,
                ZERO_OFFSET,
                HAS_GIDX,
                SCALE_MODE,
                SBN,
                SBK,
            )
            w = w.to(ROUND_DTYPE)
            if BM == 1:
                xr = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=kp_ok, other=0.0).to(tl.float32)
                acc += w.to(tl.float32) * xr[None, :]
            else:
                xi = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & kp_ok[None, :],
                    other=0.0,
                )
                if DOT_LOW:
                    acc += tl.dot(xi.to(ROUND_DTYPE), tl.trans(w))
                else:
                    acc += tl.dot(xi.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    if BM == 1:
        tl.store(out_ptr + pid_s * stride_os + pid_m * stride_om + offs_n, tl.sum(acc, axis=1), mask=n_ok)
    else:
        out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])
