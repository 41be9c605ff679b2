"""Row GEMV for packed FP8 and FP4 weights on CUDA cores: decode rows (``M <= 16``) without tensor cores.

Why not an MMA: at one row, a tensor-core GEMV pads x to 16 rows and hands every decoded weight to the MMA
in its fragment layout, so the packed tile goes through shared memory and the kernel waits on latency (the
MMA GEMV, ``decode_gemv``, ran NVFP4 at 19% of copy bandwidth). Here each thread streams 16-byte vectors of
packed bytes into registers, decodes them exactly to fp32 and multiplies with fp32 FMAs. Scales multiply
per-span partial sums (one multiply per 16-128 weights, not one per weight).

Exactness: an output's sum order is fixed by the tile constexprs alone: a sum over one scale span (16
or 32 columns, inside one thread's 16-byte vector), the scaled partials accumulated over K steps in
order, one reduction over the tile's span positions at the end. ``e2m1 × x`` and ``e4m3 × x`` are exact
in fp32 (at most 5 + 8 significant bits), so FMA contraction cannot change a product. ``ROWS`` x rows share
one decode per program and each row runs the same code, so a row's bits do not depend on the rows beside
it (MTP verify rows == decode rows; the GPU check asserts it).

Formats (the ``FMT`` numbers of ``decode_gemv``): FP8 E4M3 with ``SBN`` x ``SBK`` block scales (0) or one
scale per output row (1); E2M1 pairs with E4M3 (2, NVFP4) or E8M0 (3, MXFP4) scales per group and an optional global scale (``GLOBAL_OP`` 1: multiply, 2: divide).
"""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton
from dgpp.quant.kernels.decode_gemv import pick_segment, swiglu
from dgpp.quant.kernels.e2m1_asm import e2m1_word_fp32
from dgpp.quant.kernels.e4m3_asm import e4m3_fp32, e4m3_word_fp32
from dgpp.quant.kernels.fp4_tiles import scale_values as fp4_scale_values


@triton.jit
def _e2m1_portable(nib):
    """4-bit E2M1 codes (int32 0..15) -> exact fp32 with plain integer ops (interpreter, fp32 tests)."""
    mag = nib & 7
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)  # 2^(e-1) (1 + m/2) for e = mag >> 1 >= 1
    value = tl.where(mag >= 2, normal.to(tl.float32, bitcast=True), mag.to(tl.float32) * 0.5)
    return tl.where((nib & 8) != 0, -value, value)


@triton.jit
def _load_step(
    w_rows,
    s_ptr,
    cols,
    col_ok,
    k0,
    k_dim,
    FMT: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    SPAN: tl.constexpr,
    BK: tl.constexpr,
    EVEN: tl.constexpr,
):
    """One K step's stored words ([BN, BK / per-word] int32: 4 FP8 codes or 8 E2M1 codes each, loaded as
    words so they stay packed in registers) and its span scales [BN, BK // SPAN] (fp32; ones for per-channel FP8)."""
    PER_WORD: tl.constexpr = 4 if FMT <= 1 else 8
    offs = k0 // PER_WORD + tl.arange(0, BK // PER_WORD)
    if EVEN:
        raw = tl.load(w_rows + offs[None, :])
    else:
        raw = tl.load(
            w_rows + offs[None, :], mask=col_ok[:, None] & (offs * PER_WORD < k_dim)[None, :], other=0
        )
    if FMT == 1:
        sc = tl.full([1, 1], 1.0, tl.float32)
    else:
        offs_g = k0 // SPAN + tl.arange(0, BK // SPAN)
        if FMT == 0:  # SPAN divides SBK: each span lies in one scale block
            ptrs = s_ptr + (cols // SBN)[:, None] * tl.cdiv(k_dim, SBK) + (offs_g * SPAN // SBK)[None, :]
        else:
            ptrs = s_ptr + cols[:, None].to(tl.int64) * (k_dim // SPAN) + offs_g[None, :]
        if EVEN:
            s = tl.load(ptrs)
        else:
            s = tl.load(ptrs, mask=col_ok[:, None] & (offs_g * SPAN < k_dim)[None, :], other=0)
        if FMT == 0:
            sc = s.to(tl.float32)
        else:
            sc = fp4_scale_values(s, FMT, tl.float32)
    return raw, sc


@triton.jit
def _in_order8(n0, n1, n2, n3, n4, n5, n6, n7):
    """Eight [BN, W] tensors -> [BN, W * 8] with n_i at position i of each group of eight (joins stay in registers)."""
    pairs = (tl.join(n0, n4), tl.join(n1, n5), tl.join(n2, n6), tl.join(n3, n7))
    out = tl.join(
        tl.join(pairs[0], pairs[2]), tl.join(pairs[1], pairs[3])
    )  # [..., c, d, e] holds n_(4c + 2d + e)
    return tl.reshape(out, (n0.shape[0], n0.shape[1] * 8))


@triton.jit
def _in_order4(n0, n1, n2, n3):
    out = tl.join(tl.join(n0, n2), tl.join(n1, n3))  # [..., c, e] holds n_(2c + e)
    return tl.reshape(out, (n0.shape[0], n0.shape[1] * 4))


@triton.jit
def _decode(
    raw, FMT: tl.constexpr, SPAN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr
):
    """Stored words -> exact fp32 weights in K order, unscaled, as [BN, BK // SPAN, SPAN]."""
    if FMT <= 1:
        if FAST:
            v0, v1, v2, v3 = e4m3_word_fp32(raw)
        else:
            v0, v1, v2, v3 = (
                e4m3_fp32((raw >> 0) & 0xFF),
                e4m3_fp32((raw >> 8) & 0xFF),
                e4m3_fp32((raw >> 16) & 0xFF),
                e4m3_fp32((raw >> 24) & 0xFF),
            )
        w = _in_order4(v0, v1, v2, v3)
    else:
        if FAST:
            n0, n2, n4, n6, n1, n3, n5, n7 = e2m1_word_fp32(raw)
        else:
            n0, n1, n2, n3 = (
                _e2m1_portable(raw & 0xF),
                _e2m1_portable((raw >> 4) & 0xF),
                _e2m1_portable((raw >> 8) & 0xF),
                _e2m1_portable((raw >> 12) & 0xF),
            )
            n4, n5, n6, n7 = (
                _e2m1_portable((raw >> 16) & 0xF),
                _e2m1_portable((raw >> 20) & 0xF),
                _e2m1_portable((raw >> 24) & 0xF),
                _e2m1_portable((raw >> 28) & 0xF),
            )
        w = _in_order8(n0, n1, n2, n3, n4, n5, n6, n7)
    return tl.reshape(w, (BN, BK // SPAN, SPAN))


@triton.jit
def _row_spans(
    w, x_ptr, row, m, x_stride, k0, k_dim, SPAN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr
):
    """Per-span sums of ``w * x[row]`` for one K step: [BN, BK // SPAN] (zeros for rows >= m)."""
    kk = k0 + tl.arange(0, BK)
    mask = (kk < k_dim) & (row < m)
    if EVEN:
        mask = row < m
    xr = tl.load(x_ptr + row * x_stride + kk, mask=mask, other=0.0).to(tl.float32)
    return tl.sum(w * tl.reshape(xr, (BK // SPAN, SPAN))[None, :, :], axis=2)


@triton.jit
def _four_rows(
    a0,
    a1,
    a2,
    a3,
    w,
    sc,
    x_ptr,
    r0,
    m,
    x_stride,
    k0,
    k_dim,
    SPAN: tl.constexpr,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Rows r0 .. r0 + min(ROWS, 4) - 1 of one K step added to their accumulators (the same code for every row)."""
    a0 += _row_spans(w, x_ptr, r0, m, x_stride, k0, k_dim, SPAN, BK, EVEN) * sc
    if ROWS > 1:
        a1 += _row_spans(w, x_ptr, r0 + 1, m, x_stride, k0, k_dim, SPAN, BK, EVEN) * sc
    if ROWS > 2:
        a2 += _row_spans(w, x_ptr, r0 + 2, m, x_stride, k0, k_dim, SPAN, BK, EVEN) * sc
        a3 += _row_spans(w, x_ptr, r0 + 3, m, x_stride, k0, k_dim, SPAN, BK, EVEN) * sc
    return a0, a1, a2, a3


@triton.jit
def _finish(a0, a1, a2, a3, post):
    return tl.sum(a0, 1) * post, tl.sum(a1, 1) * post, tl.sum(a2, 1) * post, tl.sum(a3, 1) * post


@triton.jit
def row_tile(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    m,
    r0,
    k_dim,
    n_rows,
    x_stride,
    cols,
    FMT: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    SPAN: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    FAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    WIDE: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr,
):
    """``W[cols] @ x[r0 : r0 + ROWS]^T`` for one packed weight: 8 fp32 [BN] results, all scales applied (rows
    past ROWS come back as zeros). ``PREFETCH``: the next step's bytes are loaded before this step is decoded,
    so two steps of loads are in flight per thread."""
    col_ok = cols < n_rows
    row_words = k_dim // 4 if FMT <= 1 else k_dim // 8
    if EVEN and WIDE:  # K is a multiple of BK (>= 32 words' worth): rows start 16-byte aligned, 16-byte loads
        row_words = tl.multiple_of(row_words, 4)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * row_words
    a0 = tl.zeros([BN, BK // SPAN], tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    if PREFETCH:
        raw, sc = _load_step(w_rows, s_ptr, cols, col_ok, 0, k_dim, FMT, SBN, SBK, SPAN, BK, EVEN)
    for k0 in range(0, k_dim, BK):
        if PREFETCH:  # the last step re-loads itself (in bounds), cheaper than a branch
            k_next = tl.where(k0 + BK < k_dim, k0 + BK, k0)
            raw_next, sc_next = _load_step(
                w_rows, s_ptr, cols, col_ok, k_next, k_dim, FMT, SBN, SBK, SPAN, BK, EVEN
            )
        else:
            raw, sc = _load_step(w_rows, s_ptr, cols, col_ok, k0, k_dim, FMT, SBN, SBK, SPAN, BK, EVEN)
        w = _decode(raw, FMT, SPAN, BN, BK, FAST)
        if SCALE_WEIGHTS:  # scale each weight once (shared by the rows) instead of each row's span sums
            w = w * sc[:, :, None]
            sc = 1.0
        a0, a1, a2, a3 = _four_rows(
            a0, a1, a2, a3, w, sc, x_ptr, r0, m, x_stride, k0, k_dim, SPAN, BK, ROWS, EVEN
        )
        if ROWS > 4:
            a4, a5, a6, a7 = _four_rows(
                a4, a5, a6, a7, w, sc, x_ptr, r0 + 4, m, x_stride, k0, k_dim, SPAN, BK, ROWS - 4, EVEN
            )
        if PREFETCH:
            raw, sc = raw_next, sc_next
    post = tl.full([BN], 1.0, tl.float32)
    if FMT == 1:
        post = tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if GLOBAL_OP == 1:
        post = post * tl.load(g_ptr).to(tl.float32)
    elif GLOBAL_OP == 2:
        post = post / tl.load(g_ptr).to(tl.float32)
    return _finish(a0, a1, a2, a3, post), _finish(a4, a5, a6, a7, post)


@triton.jit
def _store_four(out_ptr, out_stride, out_cols, col_ok, m, r0, a0, a1, a2, a3, ROWS: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + r0 * out_stride + out_cols, a0.to(dtype), mask=col_ok & (r0 < m))
    if ROWS > 1:
        tl.store(out_ptr + (r0 + 1) * out_stride + out_cols, a1.to(dtype), mask=col_ok & (r0 + 1 < m))
    if ROWS > 2:
        tl.store(out_ptr + (r0 + 2) * out_stride + out_cols, a2.to(dtype), mask=col_ok & (r0 + 2 < m))
        tl.store(out_ptr + (r0 + 3) * out_stride + out_cols, a3.to(dtype), mask=col_ok & (r0 + 3 < m))


@triton.jit
def _store_rows(out_ptr, out_stride, out_cols, col_ok, m, r0, lo, hi, ROWS: tl.constexpr):
    """Rows r0 .. r0 + ROWS - 1 from the two four-row groups ``lo`` and ``hi``."""
    _store_four(out_ptr, out_stride, out_cols, col_ok, m, r0, lo[0], lo[1], lo[2], lo[3], ROWS)
    if ROWS > 4:
        _store_four(out_ptr, out_stride, out_cols, col_ok, m, r0 + 4, hi[0], hi[1], hi[2], hi[3], ROWS - 4)


@triton.jit
def row_multi_gemv_kernel(
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
    m,
    k_dim,
    n0,
    n1,
    n2,
    x_stride,
    out_stride,
    FMT: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    SPAN: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    FAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    WIDE: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr,
):
    """Up to three weights of one format side by side (q/k/v), outputs concatenated; grid = (BN-row tiles
    over the BN-aligned segments, chunks of ROWS x rows)."""
    w_ptr, s_ptr, g_ptr, cols, n_rows, out_base = pick_segment(
        w0, s0, g0, w1, s1, g1, w2, s2, g2, n0, n1, n2, BN
    )
    r0 = tl.program_id(1) * ROWS
    lo, hi = row_tile(
        x_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        m,
        r0,
        k_dim,
        n_rows,
        x_stride,
        cols,
        FMT,
        SBN,
        SBK,
        SPAN,
        GLOBAL_OP,
        BN,
        BK,
        ROWS,
        EVEN,
        FAST,
        PREFETCH,
        WIDE,
        SCALE_WEIGHTS,
    )
    _store_rows(out_ptr, out_stride, out_base + cols, cols < n_rows, m, r0, lo, hi, ROWS)


@triton.jit
def row_gate_up_silu_kernel(
    x_ptr,
    wg,
    sg,
    gg,
    wu,
    su,
    gu,
    out_ptr,
    m,
    k_dim,
    n_rows,
    x_stride,
    out_stride,
    FMT: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    SPAN: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    FAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    WIDE: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr,
):
    """``silu(x wg^T) * (x wu^T)`` for BN intermediate columns and ROWS x rows."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    r0 = tl.program_id(1) * ROWS
    g_lo, g_hi = row_tile(
        x_ptr,
        wg,
        sg,
        gg,
        m,
        r0,
        k_dim,
        n_rows,
        x_stride,
        cols,
        FMT,
        SBN,
        SBK,
        SPAN,
        GLOBAL_OP,
        BN,
        BK,
        ROWS,
        EVEN,
        FAST,
        PREFETCH,
        WIDE,
        SCALE_WEIGHTS,
    )
    u_lo, u_hi = row_tile(
        x_ptr,
        wu,
        su,
        gu,
        m,
        r0,
        k_dim,
        n_rows,
        x_stride,
        cols,
        FMT,
        SBN,
        SBK,
        SPAN,
        GLOBAL_OP,
        BN,
        BK,
        ROWS,
        EVEN,
        FAST,
        PREFETCH,
        WIDE,
        SCALE_WEIGHTS,
    )
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    lo = (
        swiglu(g_lo[0], u_lo[0], dtype),
        swiglu(g_lo[1], u_lo[1], dtype),
        swiglu(g_lo[2], u_lo[2], dtype),
        swiglu(g_lo[3], u_lo[3], dtype),
    )
    hi = (
        swiglu(g_hi[0], u_hi[0], dtype),
        swiglu(g_hi[1], u_hi[1], dtype),
        swiglu(g_hi[2], u_hi[2], dtype),
        swiglu(g_hi[3], u_hi[3], dtype),
    )
    _store_rows(out_ptr, out_stride, cols, cols < n_rows, m, r0, lo, hi, ROWS)
