"""Row-exact GEMM for weights packed in int32 words (int4/int8 groups, the NF4I8 codebook, GPTQ / AutoRound).

Each program owns BN output columns and up to ``BLOCKS`` blocks of 16 rows, and walks K in tiles of BKW words
(``32 / BITS`` codes each) in one fixed order. A tile's words are loaded once (whole words, so the loads
vectorize); its group scales (and GPTQ zero points) once per group; then sub-position ``i`` of every word (the
codes at K = word·PW + i) is decoded (codes -> value x scale, rounded once to the dot dtype, as the torch decode
does) and meets the matching x columns of each row block in a tensor-core dot, the weight as the MMA's A operand:
``acc_b += W_i [BN, BKW] @ x_b^T [BKW, 16]``, or (``ONE_DOT``) all of a program's blocks in one dot of up to 64
rows over the same K steps, where a device probe found that gives the same bits (``int_rows_probe``). So the packed
bytes of a tile are read and decoded once for all of a program's rows, and every row's chain (the sub-position
order, the K tiles, the K slices) is fixed by the weight's shape alone: a row's bits are the same alone and among
any number of rows. int4 words with
bf16 scales and a bf16 dot (``INT4_BF16``) decode ``code - 8`` exactly in inline PTX (``int4_asm``) and multiply
by the scale in bf16, which rounds the exact product once: the same weights in fewer instructions. With
``X_BY_POSITION`` x arrives written in step order (``x_by_position``: a step's position-0 columns, then position
1, ...), so each dot's x is one contiguous load instead of columns ``PW`` apart: the same values, the same bits.

A K slice (``SPLIT`` > 1) stores its sums in its own plane of an fp32 workspace ``[SPLIT, M, N]``, added in
slice order at the end; with one slice the program rounds and stores the output itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dgpp.quant.kernels.int4_asm import int4_centred
from dgpp.quant.kernels.wo_matmul import code_f32

FMT_INT = 0  # codes along K in [N, K·b/32] words, a scale per (row, group), fixed zero ZERO_OFFSET
FMT_NF4 = 1  # 4-bit indices along K in [N, K/8] words into a 16-entry fp32 level table, a scale per group
FMT_GPTQ = 2  # codes along K in [K·b/32, N] words, zero points packed along N per group, scales [K/group, N]

SCALES_GATHER = 0  # a scale (and zero) loaded per weight: act-order g_idx, or groups that straddle tiles
SCALES_TILE = 1  # the whole tile inside one group: one scale per output column
SCALES_GROUPS = 2  # whole groups inside the tile: one load per group, broadcast over its words

ROWS = 16  # rows per block, and per dot unless ONE_DOT: the 1-row call's dot shape
_ROWS = tl.constexpr(ROWS)  # the same, as the kernels see it


@triton.jit
def _code_value(code, zero, levels_ptr, FMT: tl.constexpr):
    """``code - zero`` as fp32 (``code_f32``: no int->float conversion), or the NF4 level of the code."""
    if FMT == 1:
        out = tl.load(levels_ptr + code)
    else:
        out = code_f32(code, zero)
    return out


@triton.jit
def _unpack_zeros(zw, offs_n, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """GPTQ zero points of columns ``offs_n`` from their packed words (``zw`` broadcast like ``offs_n``)."""
    per_word: tl.constexpr = 32 // BITS
    return ((zw >> ((offs_n % per_word) * BITS)) & ((1 << BITS) - 1)) + ZERO_OFFSET


@triton.jit
def _tile_scales(
    s_ptr,
    z_ptr,
    offs_n,
    n_ok,
    k0,
    k_hi,
    stride_sn,
    stride_sk,
    stride_zg,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BN: tl.constexpr,
    BKW: tl.constexpr,
):
    """(scale, zero) of a tile starting at K column ``k0``: [BN, 1] (SCALES_TILE) or [BN, BKW] broadcast from
    one load per group (SCALES_GROUPS); unused (zeros) for SCALES_GATHER, which loads them per weight."""
    per_word: tl.constexpr = 32 // BITS
    if SCALE_MODE == 1:
        g = k0 // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sk, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if FMT == 2:
            zw = tl.load(z_ptr + g * stride_zg + offs_n // per_word, mask=n_ok, other=0)
            zero = _unpack_zeros(zw, offs_n, BITS, ZERO_OFFSET)[:, None]
        else:
            zero = tl.full((BN, 1), ZERO_OFFSET, tl.int32)
    elif SCALE_MODE == 2:
        words_per_group: tl.constexpr = GROUP // per_word
        groups: tl.constexpr = BKW // words_per_group
        offs_g = k0 // GROUP + tl.arange(0, groups)
        ok = n_ok[:, None] & (offs_g * GROUP < k_hi)[None, :]
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk, mask=ok, other=0.0)
        s = tl.reshape(
            tl.broadcast_to(s.to(tl.float32)[:, :, None], (BN, groups, words_per_group)), (BN, BKW)
        )
        if FMT == 2:
            zw = tl.load(
                z_ptr + offs_g[None, :] * stride_zg + (offs_n // per_word)[:, None], mask=ok, other=0
            )
            zero = _unpack_zeros(zw, offs_n[:, None], BITS, ZERO_OFFSET)
            zero = tl.reshape(tl.broadcast_to(zero[:, :, None], (BN, groups, words_per_group)), (BN, BKW))
        else:
            zero = tl.full((BN, BKW), ZERO_OFFSET, tl.int32)
    else:
        s = tl.zeros((BN, 1), tl.float32)
        zero = tl.full((BN, 1), ZERO_OFFSET, tl.int32)
    return s, zero


@triton.jit
def _gathered_scales(
    s_ptr,
    z_ptr,
    gidx_ptr,
    offs_n,
    offs_k,
    ok,
    stride_sn,
    stride_sk,
    stride_zg,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    HAS_GIDX: tl.constexpr,
):
    """(scale, zero) per weight of a [BN, BKW] sub-position tile (``offs_k`` its K columns)."""
    per_word: tl.constexpr = 32 // BITS
    if HAS_GIDX:
        group = tl.load(gidx_ptr + offs_k)
    else:
        group = offs_k // GROUP
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + group[None, :] * stride_sk, mask=ok, other=0.0)
    if FMT == 2:
        zw = tl.load(z_ptr + group[None, :] * stride_zg + (offs_n // per_word)[:, None], mask=ok, other=0)
        zero = _unpack_zeros(zw, offs_n[:, None], BITS, ZERO_OFFSET)
    else:
        zero = tl.full(s.shape, ZERO_OFFSET, tl.int32)
    return s.to(tl.float32), zero


@triton.jit
def _rows_dot(
    w,
    acc,
    x_ptr,
    first_row,
    M,
    stride_xm,
    offs_x,
    k_ok,
    ROWS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    X_BY_POSITION: tl.constexpr,
):
    """``acc + w @ x[rows]^T`` for the ``ROWS`` rows from ``first_row`` at x's columns ``offs_x``: K columns ``PW``
    apart, or (``X_BY_POSITION``) one contiguous run of x written in step order, zero past K."""
    rows = first_row + tl.arange(0, ROWS)
    if X_BY_POSITION:  # whole steps, zeros past K: the rows are the only mask
        xt = tl.load(x_ptr + rows[None, :] * stride_xm + offs_x[:, None], mask=(rows < M)[None, :], other=0.0)
    else:
        xt = tl.load(
            x_ptr + rows[None, :] * stride_xm + offs_x[:, None],
            mask=(rows < M)[None, :] & k_ok[:, None],
            other=0.0,
        )
    xt = xt.to(DOT_DTYPE)
    if DOT_FP32:
        out = tl.dot(w, xt, acc, input_precision="ieee")
    else:
        out = tl.dot(w, xt, acc)
    return out


@triton.jit
def _store_rows(
    acc,
    first_row,
    out_ptr,
    ws_ptr,
    pid_s,
    M,
    N,
    stride_om,
    offs_n,
    n_ok,
    ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The sums of ``ROWS`` rows from ``first_row`` ([BN, ROWS], transposed back to rows): the output, or this K
    slice's plane."""
    rows = first_row + tl.arange(0, ROWS)
    ok = (rows < M)[None, :] & n_ok[:, None]
    if SPLIT == 1:
        tl.store(
            out_ptr + rows[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=ok
        )
    else:
        tl.store(ws_ptr + pid_s * M * N + rows[None, :] * N + offs_n[:, None], acc, mask=ok)


@triton.jit
def _block_dot(
    w,
    acc,
    x_ptr,
    block,
    M,
    stride_xm,
    offs_x,
    k_ok,
    DOT_DTYPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    X_BY_POSITION: tl.constexpr,
):
    """``_rows_dot`` for the 16 rows of row block ``block``."""
    return _rows_dot(
        w, acc, x_ptr, block * _ROWS, M, stride_xm, offs_x, k_ok, _ROWS, DOT_DTYPE, DOT_FP32, X_BY_POSITION
    )


@triton.jit
def _store_block(acc, block, out_ptr, ws_ptr, pid_s, M, N, stride_om, offs_n, n_ok, SPLIT: tl.constexpr):
    """``_store_rows`` for the 16 rows of row block ``block``."""
    _store_rows(acc, block * _ROWS, out_ptr, ws_ptr, pid_s, M, N, stride_om, offs_n, n_ok, _ROWS, SPLIT)


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
    SCALE_MODE: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCKS: tl.constexpr,
    BN: tl.constexpr,
    BKW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INT4_BF16: tl.constexpr = False,
    X_BY_POSITION: tl.constexpr = False,
    ONE_DOT: tl.constexpr = False,
):
    """Program (column tile, K slice, group of BLOCKS row blocks): each block's sums over the slice kept in
    registers tile after tile, then stored once. Every block runs the same dots in the same order whatever M
    and BLOCKS are; with ``ONE_DOT`` the blocks' dots are one dot of ``BLOCKS`` x 16 rows (the same K steps, so
    the same chain per output where the MMA's row count does not enter a column's sums: Hopper's wgmma)."""
    per_word: tl.constexpr = 32 // BITS
    code_mask: tl.constexpr = (1 << BITS) - 1
    WIDE_ROWS: tl.constexpr = BLOCKS * _ROWS  # the one dot's rows
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    first = tl.program_id(2) * BLOCKS
    first_row = first * _ROWS
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    wide = tl.zeros((BN, WIDE_ROWS), dtype=tl.float32)
    acc0 = tl.zeros((BN, _ROWS), dtype=tl.float32)
    acc1 = tl.zeros((BN, _ROWS), dtype=tl.float32)
    acc2 = tl.zeros((BN, _ROWS), dtype=tl.float32)
    acc3 = tl.zeros((BN, _ROWS), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BKW * per_word):
        # slices start on whole tiles (the host's k_per_split), so a tile's words start BKW-aligned
        offs_w = tl.multiple_of(k0 // per_word, BKW) + tl.arange(0, BKW)
        if EVEN_K:  # K holds whole tiles: no K mask, so the word loads vectorize
            w_ok = n_ok[:, None] & (offs_w >= 0)[None, :]
        else:
            w_ok = n_ok[:, None] & (offs_w < k_hi // per_word)[None, :]
        if FMT == 2:  # words [K·b/32, N]: unit stride along N
            w_ptrs = w_ptr + offs_n[:, None] + offs_w[None, :] * stride_wk
        else:  # words [N, K·b/32]: unit stride along K
            w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :]
        words = tl.load(w_ptrs, mask=w_ok, other=0)
        s, zero = _tile_scales(
            s_ptr,
            z_ptr,
            offs_n,
            n_ok,
            k0,
            k_hi,
            stride_sn,
            stride_sk,
            stride_zg,
            FMT,
            BITS,
            GROUP,
            ZERO_OFFSET,
            SCALE_MODE,
            BN,
            BKW,
        )
        for i in tl.static_range(per_word):
            offs_k = offs_w * per_word + i
            k_ok = offs_k < k_hi
            if SCALE_MODE == 0:
                s, zero = _gathered_scales(
                    s_ptr,
                    z_ptr,
                    gidx_ptr,
                    offs_n,
                    tl.where(k_ok, offs_k, 0),
                    w_ok,
                    stride_sn,
                    stride_sk,
                    stride_zg,
                    FMT,
                    BITS,
                    GROUP,
                    ZERO_OFFSET,
                    HAS_GIDX,
                )
            if INT4_BF16:  # code - 8 exact in bf16, times the bf16 scale: one rounding
                w = int4_centred(words, i) * s.to(tl.bfloat16)
            else:  # rounded once to the dot dtype
                code = (words >> (i * BITS)) & code_mask
                w = (_code_value(code, zero, levels_ptr, FMT) * s).to(DOT_DTYPE)
            if X_BY_POSITION:  # x in step order: position i's columns of this step are one run
                offs_x = tl.multiple_of(k0 + i * BKW, BKW) + tl.arange(0, BKW)
            else:
                offs_x = offs_k
            if ONE_DOT:
                wide = _rows_dot(
                    w,
                    wide,
                    x_ptr,
                    first_row,
                    M,
                    stride_xm,
                    offs_x,
                    k_ok,
                    WIDE_ROWS,
                    DOT_DTYPE,
                    DOT_FP32,
                    X_BY_POSITION,
                )
            else:
                acc0 = _block_dot(
                    w, acc0, x_ptr, first, M, stride_xm, offs_x, k_ok, DOT_DTYPE, DOT_FP32, X_BY_POSITION
                )
            if BLOCKS > 1 and not ONE_DOT:
                acc1 = _block_dot(
                    w, acc1, x_ptr, first + 1, M, stride_xm, offs_x, k_ok, DOT_DTYPE, DOT_FP32, X_BY_POSITION
                )
            if BLOCKS > 2 and not ONE_DOT:
                acc2 = _block_dot(
                    w, acc2, x_ptr, first + 2, M, stride_xm, offs_x, k_ok, DOT_DTYPE, DOT_FP32, X_BY_POSITION
                )
                acc3 = _block_dot(
                    w, acc3, x_ptr, first + 3, M, stride_xm, offs_x, k_ok, DOT_DTYPE, DOT_FP32, X_BY_POSITION
                )
    if ONE_DOT:
        _store_rows(wide, first_row, out_ptr, ws_ptr, pid_s, M, N, stride_om, offs_n, n_ok, WIDE_ROWS, SPLIT)
    else:
        _store_block(acc0, first, out_ptr, ws_ptr, pid_s, M, N, stride_om, offs_n, n_ok, SPLIT)
    if BLOCKS > 1 and not ONE_DOT:
        _store_block(acc1, first + 1, out_ptr, ws_ptr, pid_s, M, N, stride_om, offs_n, n_ok, SPLIT)
    if BLOCKS > 2 and not ONE_DOT:
        _store_block(acc2, first + 2, out_ptr, ws_ptr, pid_s, M, N, stride_om, offs_n, n_ok, SPLIT)
        _store_block(acc3, first + 3, out_ptr, ws_ptr, pid_s, M, N, stride_om, offs_n, n_ok, SPLIT)


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
