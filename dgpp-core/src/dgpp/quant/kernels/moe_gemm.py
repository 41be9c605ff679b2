"""Grouped GEMM over routed experts whose weights stay packed: the quantized twin of ``dgpp.kernels.moe``.

Rows are the ``T*K`` (token, expert) assignments sorted by expert in blocks of ``BM`` rows
(``dgpp.kernels.moe.align_to_experts``), so one launch serves every expert and each block reads its
expert's packed weight tiles once. Each stored [BN, BKP] tile is decoded in registers
(``moe_weight_tiles``) by the same helpers as the weight-only linear (``wo_matmul``: FP8 block/channel, E2M1 with E4M3/E8M0 group scales
and a global, packed int and GPTQ words), rounded to the activation dtype like the torch reference
decode, then fed to ``tl.dot``. The first GEMM gathers token rows and fuses SwiGLU (gate and up are
two stacks, each with its own scales and global); the second scales each row by its routing weight
and writes it at its assignment index, so the caller sums each token's ``K`` rows in a fixed order.
Every expert-dependent quantity is read on the device: nothing here needs the host.

E2M1 weights with bf16 activations (``FP4_EXACT``) skip the rounding: a 2-bit E2M1 significand times a 4-bit
E4M3 or power-of-two E8M0 scale fits bf16's 8 bits, so ``code * scale`` is an exact bf16 product (one packed
multiply per two weights), and the per-expert global multiplies (or divides) each fp32 sum once after the K loop.
Their scale bytes and activation pairs load one K step ahead of their use. int4 words with bf16 scales and
activations (``INT4_BF16``) decode ``code - 8`` to bf16 exactly in inline PTX (``int4_asm``) and multiply by the
scale in bf16: one rounding of the exact product, the value the fp32 decode rounds to. Eight codes a word
(``A_STEP_ORDER``): the activations arrive written in step order (``x_by_position``), so position ``i``'s
columns of a K step are one contiguous load instead of columns 16 bytes apart: the same values in the same dots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dgpp.quant.kernels.moe_weight_tiles import group_scale_bytes, step_scales, weight_operand


@triton.jit
def _activation_pairs(a_ptr, a_rows, a_row_stride, rvalid, offs_kp, kp_ok):
    """Activation columns (2j, 2j + 1) for stored pair j as [BM, BKP, 2] (contiguous, so the load vectorizes
    and ``tl.split`` needs no data movement), instead of two stride-2 loads."""
    cols = offs_kp[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    mask = rvalid[:, None, None] & kp_ok[None, :, None]
    return tl.load(a_ptr + a_rows[:, None, None] * a_row_stride + cols, mask=mask, other=0.0)


@triton.jit
def _dot(a, w, ROUND_DTYPE: tl.constexpr, DOT_LOW: tl.constexpr):
    """``a [BM, BKP] @ w [BN, BKP]^T``: tensor cores in the activation dtype, or exact fp32 (fp32
    activations, and the interpreter whose bf16 dot is wrong)."""
    if DOT_LOW:
        return tl.dot(a.to(ROUND_DTYPE), tl.trans(w))
    return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")


@triton.jit
def _block_rows(sorted_ids_ptr, first, num_assign, top_k, ROWS: tl.constexpr, GATHER_TOKENS: tl.constexpr):
    """Sorted rows ``first .. first + ROWS - 1``: the rows, their assignment ids, which hold an assignment, and
    the rows of ``a`` they read (the first GEMM reads token rows; the second its own sorted rows)."""
    rows = first + tl.arange(0, ROWS)
    sid = tl.load(sorted_ids_ptr + rows)
    rvalid = sid < num_assign
    if GATHER_TOKENS:
        a_rows = (sid // top_k).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    return rows, sid, rvalid, a_rows


@triton.jit
def _pairs_step(
    carried, a_ptr, a_rows, a_row_stride, rvalid, offs_kp, kp_ok, KP, BKP: tl.constexpr, AHEAD: tl.constexpr
):
    """E2M1 pairs: one row block's even and odd activation columns of the K step at ``offs_kp``, and what it
    carries to the next step (``AHEAD``: the pairs were loaded a step ahead in ``carried``; the next step's load
    now)."""
    if AHEAD:
        lo, hi = tl.split(carried)
        ahead = offs_kp + BKP
        carried = _activation_pairs(a_ptr, a_rows, a_row_stride, rvalid, ahead, ahead < KP)
    else:
        lo, hi = tl.split(_activation_pairs(a_ptr, a_rows, a_row_stride, rvalid, offs_kp, kp_ok))
    return lo, hi, carried


@triton.jit
def _a_columns(
    a_ptr,
    a_rows,
    a_row_stride,
    rvalid,
    lo,
    hi,
    kp0,
    offs_k,
    kp_ok,
    i,
    PACK: tl.constexpr,
    BKP: tl.constexpr,
    A_STEP_ORDER: tl.constexpr,
):
    """One row block's activations for sub-position ``i`` of a K step: E2M1 pairs' half (``lo`` / ``hi``), or
    loaded (in step order, ``x_by_position``: position ``i``'s columns one run, zeros past K; else by column)."""
    if PACK == 2:
        if i == 0:
            a = lo
        else:
            a = hi
    elif A_STEP_ORDER:
        offs_a = tl.multiple_of(kp0 * PACK + i * BKP, BKP) + tl.arange(0, BKP)
        a = tl.load(a_ptr + a_rows[:, None] * a_row_stride + offs_a[None, :], mask=rvalid[:, None], other=0.0)
    else:
        a = tl.load(
            a_ptr + a_rows[:, None] * a_row_stride + offs_k[None, :],
            mask=rvalid[:, None] & kp_ok[None, :],
            other=0.0,
        )
    return a


@triton.jit
def _block_dots(
    acc, acc_up, a, w, w_up, SWIGLU: tl.constexpr, ROUND_DTYPE: tl.constexpr, DOT_LOW: tl.constexpr
):
    """One row block's dots of a sub-position into its gate (or only) and up accumulators."""
    acc += _dot(a, w, ROUND_DTYPE, DOT_LOW)
    if SWIGLU:
        acc_up += _dot(a, w_up, ROUND_DTYPE, DOT_LOW)
    return acc, acc_up


@triton.jit
def _store_block(
    acc,
    acc_up,
    g,
    g2,
    rows,
    sid,
    rvalid,
    offs_n,
    n_ok,
    c_ptr,
    c_row_stride,
    topk_w_ptr,
    GLOBAL_OP: tl.constexpr,
    FP4_EXACT: tl.constexpr,
    SWIGLU: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr,
    SCATTER_WEIGHTED: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
):
    """One row block's output: the E2M1 global once per sum, SwiGLU (gate and up rounded to the activation dtype
    first, as the reference), the routing weight and the scatter to assignment rows."""
    if FP4_EXACT and GLOBAL_OP == 1:  # the global, once per sum (the tile's weights were exact without it)
        acc = acc * g
        acc_up = acc_up * g2
    elif FP4_EXACT and GLOBAL_OP == 2:
        acc = acc / g
        acc_up = acc_up / g2
    if SWIGLU:
        gate = acc.to(ROUND_DTYPE).to(tl.float32)
        up = acc_up.to(ROUND_DTYPE).to(tl.float32)
        if SWIGLU_LIMIT > 0:  # clamped SwiGLU (DeepSeek-V4): gate <= limit, -limit <= up <= limit
            gate = tl.minimum(gate, SWIGLU_LIMIT)
            up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    c_rows = rows.to(tl.int64)
    if SCATTER_WEIGHTED:
        acc = acc * tl.load(topk_w_ptr + sid, mask=rvalid, other=0.0).to(tl.float32)[:, None]
        c_rows = sid.to(tl.int64)
    tl.store(
        c_ptr + c_rows[:, None] * c_row_stride + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=rvalid[:, None] & n_ok[None, :],
    )


@triton.jit
def quant_moe_gemm_kernel(
    a_ptr,
    c_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    topk_w_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    w2_ptr,
    s2_ptr,
    z2_ptr,
    g2_ptr,
    num_assign,
    top_k,
    N,
    KP,
    a_row_stride,
    c_row_stride,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ze,
    stride_zk,
    stride_ge,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    FMT: tl.constexpr,
    PACK: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    GLOBAL_OP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    DOT_LOW: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    GATHER_TOKENS: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCATTER_WEIGHTED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKP: tl.constexpr,
    FAST_E2M1: tl.constexpr = False,
    SWIGLU_LIMIT: tl.constexpr = 0.0,
    FP4_EXACT: tl.constexpr = False,
    INT4_BF16: tl.constexpr = False,
    A_STEP_ORDER: tl.constexpr = False,
    BLOCKS: tl.constexpr = 1,
):
    """``c[row] = a[row] @ W_e^T`` for one block of BM sorted rows (expert ``e``) and BN output columns.
    ``w/s/z/g``: the (gate or down) stack; ``w2/s2/z2/g2``: the up stack (SWIGLU only); every stack is
    [E, *stored] with expert stride ``stride_*e``. Blocks past the used ones run no iterations.

    ``BLOCKS`` (1, 2 or 4): the BM rows run as that many row blocks of BM / BLOCKS rows, each weight tile decoded
    once for all of them and met by each block in its own dot: a row's chain and instruction are those of a
    BM / BLOCKS-row program, so its bits are too (``moe_launch.blocked_tiles``)."""
    ROWS: tl.constexpr = BM // BLOCKS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    kp_end = tl.where(expert >= 0, KP, 0)
    expert = tl.maximum(expert, 0)
    rows0, sid0, rvalid0, a_rows0 = _block_rows(
        sorted_ids_ptr, pid_m * BM, num_assign, top_k, ROWS, GATHER_TOKENS
    )
    rows1, sid1, rvalid1, a_rows1 = rows0, sid0, rvalid0, a_rows0
    rows2, sid2, rvalid2, a_rows2 = rows0, sid0, rvalid0, a_rows0
    rows3, sid3, rvalid3, a_rows3 = rows0, sid0, rvalid0, a_rows0
    if BLOCKS > 1:
        rows1, sid1, rvalid1, a_rows1 = _block_rows(
            sorted_ids_ptr, pid_m * BM + ROWS, num_assign, top_k, ROWS, GATHER_TOKENS
        )
    if BLOCKS > 2:
        rows2, sid2, rvalid2, a_rows2 = _block_rows(
            sorted_ids_ptr, pid_m * BM + 2 * ROWS, num_assign, top_k, ROWS, GATHER_TOKENS
        )
        rows3, sid3, rvalid3, a_rows3 = _block_rows(
            sorted_ids_ptr, pid_m * BM + 3 * ROWS, num_assign, top_k, ROWS, GATHER_TOKENS
        )
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_ze
    w2_base = w2_ptr + expert * stride_we
    s2_base = s2_ptr + expert * stride_se
    z2_base = z2_ptr + expert * stride_ze
    g = 1.0
    g2 = 1.0
    if GLOBAL_OP != 0:
        g = tl.load(g_ptr + expert * stride_ge).to(tl.float32)
        if SWIGLU:
            g2 = tl.load(g2_ptr + expert * stride_ge).to(tl.float32)
    acc0 = tl.zeros((ROWS, BN), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    up0 = acc0
    up1 = acc0
    up2 = acc0
    up3 = acc0
    # E2M1 pairs: scale bytes and activation pairs load a K step ahead of their use, so their latency hides
    next_a0 = 0
    next_a1 = 0
    next_a2 = 0
    next_a3 = 0
    if FP4_EXACT:
        GSP: tl.constexpr = SBK // PACK
        next_s = group_scale_bytes(s_base, offs_n, n_ok, 0, kp_end, stride_sn, stride_sk, GSP, BKP)
        next_s_up = group_scale_bytes(s2_base, offs_n, n_ok, 0, kp_end, stride_sn, stride_sk, GSP, BKP)
        first = tl.arange(0, BKP)
        next_a0 = _activation_pairs(a_ptr, a_rows0, a_row_stride, rvalid0, first, first < kp_end)
        if BLOCKS > 1:
            next_a1 = _activation_pairs(a_ptr, a_rows1, a_row_stride, rvalid1, first, first < kp_end)
        if BLOCKS > 2:
            next_a2 = _activation_pairs(a_ptr, a_rows2, a_row_stride, rvalid2, first, first < kp_end)
            next_a3 = _activation_pairs(a_ptr, a_rows3, a_row_stride, rvalid3, first, first < kp_end)
    else:  # nothing is carried between K steps
        next_s = 0
        next_s_up = 0
    for kp0 in range(0, kp_end, BKP):
        offs_kp = kp0 + tl.arange(0, BKP)
        kp_ok = offs_kp < KP
        tile_ok = n_ok[:, None] & kp_ok[None, :]
        w_off = offs_n[:, None] * stride_wn + offs_kp[None, :] * stride_wk
        stored = tl.load(w_base + w_off, mask=tile_ok, other=0)
        s_pre, z_row, next_s = step_scales(
            next_s,
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
            FP4_EXACT,
        )
        if SWIGLU:
            stored_up = tl.load(w2_base + w_off, mask=tile_ok, other=0)
            s_up, z_up, next_s_up = step_scales(
                next_s_up,
                s2_base,
                z2_base,
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
                FP4_EXACT,
            )
        else:  # unused: keeps every name defined on both constexpr branches
            stored_up = stored
            s_up = s_pre
            z_up = z_row
        # E2M1 pairs: activations loaded as [ROWS, BKP, 2] column pairs, split in registers
        lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3 = 0, 0, 0, 0, 0, 0, 0, 0
        if PACK == 2:
            lo0, hi0, next_a0 = _pairs_step(
                next_a0, a_ptr, a_rows0, a_row_stride, rvalid0, offs_kp, kp_ok, KP, BKP, FP4_EXACT
            )
            if BLOCKS > 1:
                lo1, hi1, next_a1 = _pairs_step(
                    next_a1, a_ptr, a_rows1, a_row_stride, rvalid1, offs_kp, kp_ok, KP, BKP, FP4_EXACT
                )
            if BLOCKS > 2:
                lo2, hi2, next_a2 = _pairs_step(
                    next_a2, a_ptr, a_rows2, a_row_stride, rvalid2, offs_kp, kp_ok, KP, BKP, FP4_EXACT
                )
                lo3, hi3, next_a3 = _pairs_step(
                    next_a3, a_ptr, a_rows3, a_row_stride, rvalid3, offs_kp, kp_ok, KP, BKP, FP4_EXACT
                )
        for i in tl.static_range(PACK):
            offs_k = offs_kp * PACK + i
            w = weight_operand(
                stored,
                i,
                offs_n,
                offs_k,
                kp_ok,
                tile_ok,
                s_base,
                z_base,
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
                SCALE_MODE,
                SBN,
                SBK,
                FAST_E2M1,
                ROUND_DTYPE,
                DOT_LOW,
                FP4_EXACT,
                INT4_BF16,
            )
            w_up = w
            if SWIGLU:
                w_up = weight_operand(
                    stored_up,
                    i,
                    offs_n,
                    offs_k,
                    kp_ok,
                    tile_ok,
                    s2_base,
                    z2_base,
                    g2,
                    s_up,
                    z_up,
                    stride_sn,
                    stride_sk,
                    stride_zk,
                    FMT,
                    BITS,
                    SCALE_E8M0,
                    GLOBAL_OP,
                    ZERO_OFFSET,
                    SCALE_MODE,
                    SBN,
                    SBK,
                    FAST_E2M1,
                    ROUND_DTYPE,
                    DOT_LOW,
                    FP4_EXACT,
                    INT4_BF16,
                )
            a = _a_columns(
                a_ptr,
                a_rows0,
                a_row_stride,
                rvalid0,
                lo0,
                hi0,
                kp0,
                offs_k,
                kp_ok,
                i,
                PACK,
                BKP,
                A_STEP_ORDER,
            )
            acc0, up0 = _block_dots(acc0, up0, a, w, w_up, SWIGLU, ROUND_DTYPE, DOT_LOW)
            if BLOCKS > 1:
                a = _a_columns(
                    a_ptr,
                    a_rows1,
                    a_row_stride,
                    rvalid1,
                    lo1,
                    hi1,
                    kp0,
                    offs_k,
                    kp_ok,
                    i,
                    PACK,
                    BKP,
                    A_STEP_ORDER,
                )
                acc1, up1 = _block_dots(acc1, up1, a, w, w_up, SWIGLU, ROUND_DTYPE, DOT_LOW)
            if BLOCKS > 2:
                a = _a_columns(
                    a_ptr,
                    a_rows2,
                    a_row_stride,
                    rvalid2,
                    lo2,
                    hi2,
                    kp0,
                    offs_k,
                    kp_ok,
                    i,
                    PACK,
                    BKP,
                    A_STEP_ORDER,
                )
                acc2, up2 = _block_dots(acc2, up2, a, w, w_up, SWIGLU, ROUND_DTYPE, DOT_LOW)
                a = _a_columns(
                    a_ptr,
                    a_rows3,
                    a_row_stride,
                    rvalid3,
                    lo3,
                    hi3,
                    kp0,
                    offs_k,
                    kp_ok,
                    i,
                    PACK,
                    BKP,
                    A_STEP_ORDER,
                )
                acc3, up3 = _block_dots(acc3, up3, a, w, w_up, SWIGLU, ROUND_DTYPE, DOT_LOW)
    _store_block(
        acc0,
        up0,
        g,
        g2,
        rows0,
        sid0,
        rvalid0,
        offs_n,
        n_ok,
        c_ptr,
        c_row_stride,
        topk_w_ptr,
        GLOBAL_OP,
        FP4_EXACT,
        SWIGLU,
        SWIGLU_LIMIT,
        SCATTER_WEIGHTED,
        ROUND_DTYPE,
    )
    if BLOCKS > 1:
        _store_block(
            acc1,
            up1,
            g,
            g2,
            rows1,
            sid1,
            rvalid1,
            offs_n,
            n_ok,
            c_ptr,
            c_row_stride,
            topk_w_ptr,
            GLOBAL_OP,
            FP4_EXACT,
            SWIGLU,
            SWIGLU_LIMIT,
            SCATTER_WEIGHTED,
            ROUND_DTYPE,
        )
    if BLOCKS > 2:
        _store_block(
            acc2,
            up2,
            g,
            g2,
            rows2,
            sid2,
            rvalid2,
            offs_n,
            n_ok,
            c_ptr,
            c_row_stride,
            topk_w_ptr,
            GLOBAL_OP,
            FP4_EXACT,
            SWIGLU,
            SWIGLU_LIMIT,
            SCATTER_WEIGHTED,
            ROUND_DTYPE,
        )
        _store_block(
            acc3,
            up3,
            g,
            g2,
            rows3,
            sid3,
            rvalid3,
            offs_n,
            n_ok,
            c_ptr,
            c_row_stride,
            topk_w_ptr,
            GLOBAL_OP,
            FP4_EXACT,
            SWIGLU,
            SWIGLU_LIMIT,
            SCATTER_WEIGHTED,
            ROUND_DTYPE,
        )
