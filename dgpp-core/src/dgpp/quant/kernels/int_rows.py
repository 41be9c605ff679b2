"""Row-exact GEMM for weights packed in int32 words (int4/int8 groups, the NF4I8 codebook, GPTQ / AutoRound).

Each program owns BN output columns of 16 rows and walks K in BK tiles in one fixed order: it decodes a tile of
packed weights (codes -> value x scale, rounded once to the dot dtype, as the torch decode does) and multiplies it
against its rows, 16 rows per dot, the sums kept in registers. A K slice (``SPLIT`` > 1) stores its sums in its own
plane of an fp32 workspace ``[SPLIT, M, N]``, and the planes are added in slice order at the end; with one slice
the program rounds and stores the output itself. The dot shape, the K order and the split come from
the weight's shape alone, never from M, so a row's bits are the same alone and among any number of rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

FMT_INT = 0  # codes along K in [N, K·b/32] words, a scale per (row, group), fixed zero ZERO_OFFSET
FMT_NF4 = 1  # 4-bit indices along K in [N, K/8] words into a 16-entry fp32 level table, a scale per group
FMT_GPTQ = 2  # codes along K in [K·b/32, N] words, zero points packed along N per group, scales [K/group, N]


@triton.jit
def _decode_tile(
    w_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    levels_ptr,
    offs_n,
    offs_k,
    ok,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_zg,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    HAS_GIDX: tl.constexpr,
):
    """The fp32 weights ``W[offs_n, offs_k]`` (before rounding to the dot dtype) of a [BN, BK] tile."""
    per_word: tl.constexpr = 32 // BITS
    mask: tl.constexpr = (1 << BITS) - 1
    word = tl.load(
        w_ptr + offs_n[:, None] * stride_wn + (offs_k // per_word)[None, :] * stride_wk, mask=ok, other=0
    )
    code = (word >> ((offs_k % per_word) * BITS)[None, :]) & mask
    if HAS_GIDX:
        group = tl.load(gidx_ptr + offs_k)
    else:
        group = offs_k // GROUP
    scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + group[None, :] * stride_sk, mask=ok, other=0.0)
    if FMT == 0:
        value = (code - ZERO_OFFSET).to(tl.float32)
    elif FMT == 1:
        value = tl.load(levels_ptr + code)
    else:
        zw = tl.load(z_ptr + group[None, :] * stride_zg + (offs_n // per_word)[:, None], mask=ok, other=0)
        zero = ((zw >> ((offs_n % per_word) * BITS)[:, None]) & mask) + ZERO_OFFSET
        value = (code - zero).to(tl.float32)
    return value * scale.to(tl.float32)


@triton.jit
def int_rows_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    levels_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_om,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_zg,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (column tile, K slice, block of BM rows): its rows' sums over its K range, kept in registers tile
    after tile (so the weight loads pipeline), then stored once: the output itself when there is one K slice,
    else the slice's plane of ``ws`` for ``int_rows_finish`` to add. A block's sums run the same dot shape over
    the same K order whatever M is."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_ok = offs_m < M
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < k_hi
        ok = n_ok[:, None] & k_ok[None, :]
        w = _decode_tile(
            w_ptr,
            s_ptr,
            z_ptr,
            gidx_ptr,
            levels_ptr,
            offs_n,
            tl.where(k_ok, offs_k, 0),
            ok,
            stride_wn,
            stride_wk,
            stride_sn,
            stride_sk,
            stride_zg,
            FMT,
            BITS,
            GROUP,
            ZERO_OFFSET,
            HAS_GIDX,
        )
        wt = tl.trans(tl.where(ok, w, 0.0).to(DOT_DTYPE))  # rounded once to the compute dtype
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        if DOT_FP32:
            acc = tl.dot(x, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, wt, acc)
    acc_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=acc_ok,
        )
    else:
        tl.store(ws_ptr + pid_s * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=acc_ok)


@triton.jit
def int_rows_finish(ws_ptr, out_ptr, M, N, stride_om, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """``out = Σ_slices ws[slice]`` in slice order, rounded once to the output dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    total = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLIT):
        total += tl.load(ws_ptr + s * M * N + offs, mask=ok, other=0.0)
    row = offs // N
    col = offs % N
    tl.store(out_ptr + row * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=ok)
