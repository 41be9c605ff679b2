"""Varlen causal prefill attention over the paged K/V pool (flash-style, GQA).

``q [T, Hq, D]`` holds the new rows of every sequence (``query_start_loc [B+1]``); sequence ``b``'s rows
sit at positions ``context_lens[b] ..`` and their K/V were already written to the pool, so each row
attends to the pool's first ``context + i + 1`` tokens of its sequence (earlier chunks included).
Returns ``[T, Hq, Dv]`` in q's dtype. ``scales``: an e4m3 pool's fp32 row scales ``(k_scale, v_scale)``
(``engine.kv_dtype: fp8``); each loaded K/V tile is dequantized once (``dgpp.kernels.kv_fp8``).

The Triton path gives one program to each (block of ``BLOCK_M`` query rows of one sequence, query
head): it streams the sequence's K/V blocks through an online softmax, never materialising the
score matrix, and skips the key blocks wholly above the causal diagonal. The block-to-sequence map
is built on the host (prefill runs eagerly). ``dgpp.nn.attention`` uses it on CUDA by default
(``DGPP_PREFILL_ATTN=torch`` opts out); its speed against the torch path is in docs/benchmarks.md.
"""

from __future__ import annotations

import functools

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.kv_fp8 import KVScales, dequantize_rows, dequantize_tile


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    scales: KVScales = None,
) -> torch.Tensor:
    hq, hk = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.zeros(q.shape[0], hq, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        rows = starts[b + 1] - starts[b]
        if rows == 0:
            continue
        tok = torch.arange(ctx + rows, device=q.device)
        phys = block_tables[b, tok // bs].long()
        k, v = k_cache[phys, tok % bs], v_cache[phys, tok % bs]
        if scales is not None:
            k = dequantize_rows(k, scales[0][phys, tok % bs], q.dtype)
            v = dequantize_rows(v, scales[1][phys, tok % bs], q.dtype)
        k = k.float().repeat_interleave(hq // hk, dim=1)
        v = v.float().repeat_interleave(hq // hk, dim=1)
        qb = q[starts[b] : starts[b + 1]].float()
        scores = torch.einsum("nhd,lhd->hnl", qb, k) * scale
        visible = tok[None, :] <= (ctx + torch.arange(rows, device=q.device))[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[starts[b] : starts[b + 1]] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def _attend_block(
    q,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    ksc_ptr,
    vsc_ptr,
    bt_ptr,
    b,
    bt_b,
    n0,
    end,
    q_pos,
    qk_scale,
    kvh,
    d,
    dv,
    head_dim,
    v_dim,
    block_size,
    k_blk,
    k_tok,
    k_head,
    v_blk,
    v_tok,
    v_head,
    sc_blk,
    sc_tok,
    sc_head,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    """One key block of the online softmax (base 2: ``qk_scale`` carries log2(e)). Unmasked blocks lie wholly
    below the diagonal of every row of the query block, so they skip the causal and length masks."""
    toks = n0 + tl.arange(0, BLOCK_N)
    tmask = toks < end
    phys = tl.load(bt_ptr + b * bt_b + toks // block_size, mask=tmask, other=0).to(tl.int64)
    off = (toks % block_size).to(tl.int64)
    kt = tl.load(
        k_ptr + (phys * k_blk + off * k_tok + kvh * k_head)[None, :] + d[:, None],
        mask=tmask[None, :] & (d[:, None] < head_dim),
        other=0.0,
    )
    if HAS_SCALES:  # e4m3 rows: code * row scale, rounded once to the compute dtype
        sc_rows = phys * sc_blk + off * sc_tok + kvh * sc_head
        kt = dequantize_tile(kt, ksc_ptr, sc_rows, tmask, q.dtype, True)
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where(tmask[None, :] & (toks[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the sequence see no key
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_ptr + (phys * v_blk + off * v_tok + kvh * v_head)[:, None] + dv[None, :],
        mask=tmask[:, None] & (dv[None, :] < v_dim),
        other=0.0,
    )
    if HAS_SCALES:
        v = dequantize_tile(v, vsc_ptr, sc_rows, tmask, q.dtype, False)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ksc_ptr,
    vsc_ptr,
    out_ptr,
    bt_ptr,
    blk_seq_ptr,
    blk_row_ptr,
    starts_ptr,
    ctx_ptr,
    qk_scale,
    group,
    head_dim,
    v_dim,
    block_size,
    q_t,
    q_h,
    k_blk,
    k_tok,
    k_head,
    v_blk,
    v_tok,
    v_head,
    sc_blk,
    sc_tok,
    sc_head,
    bt_b,
    o_t,
    o_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    head = tl.program_id(0)
    blk = tl.program_id(1)  # the host lists query blocks longest context first, so the heaviest start first
    kvh = head // group
    b = tl.load(blk_seq_ptr + blk).to(tl.int64)
    first_row = tl.load(blk_row_ptr + blk)  # offset of this block's first row inside its sequence
    seq_start = tl.load(starts_ptr + b)
    n_rows = tl.load(starts_ptr + b + 1) - seq_start
    ctx = tl.load(ctx_ptr + b)
    m_idx = first_row + tl.arange(0, BLOCK_M)
    m_mask = m_idx < n_rows
    rows = (seq_start + m_idx).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + rows[:, None] * q_t + head * q_h + d[None, :],
        mask=m_mask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    q_pos = ctx + m_idx  # absolute position of each query row
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # keys before the block's first row are visible to all its rows; later ones up to its last row need the
    # causal mask; key blocks past that are above the diagonal and never loaded
    end = ctx + tl.minimum(first_row + BLOCK_M, n_rows)
    full_end = (ctx + first_row) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            ksc_ptr,
            vsc_ptr,
            bt_ptr,
            b,
            bt_b,
            n0,
            end,
            q_pos,
            qk_scale,
            kvh,
            d,
            dv,
            head_dim,
            v_dim,
            block_size,
            k_blk,
            k_tok,
            k_head,
            v_blk,
            v_tok,
            v_head,
            sc_blk,
            sc_tok,
            sc_head,
            BLOCK_N,
            False,
            PRECISION,
            HAS_SCALES,
        )
    for n0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            ksc_ptr,
            vsc_ptr,
            bt_ptr,
            b,
            bt_b,
            n0,
            end,
            q_pos,
            qk_scale,
            kvh,
            d,
            dv,
            head_dim,
            v_dim,
            block_size,
            k_blk,
            k_tok,
            k_head,
            v_blk,
            v_tok,
            v_head,
            sc_blk,
            sc_tok,
            sc_head,
            BLOCK_N,
            True,
            PRECISION,
            HAS_SCALES,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * o_t + head * o_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & (dv[None, :] < v_dim),
    )


# (BLOCK_M, BLOCK_N, num_warps, num_stages). H200 sweep, bf16, 32/8 heads x 128: 8192 rows 2.26 ms (244
# TFLOP/s) with 128x128 tiles against 2.72 ms with 64x64; 1024 rows over a 4096 context 0.47 ms vs 0.51.
# Rows wider than 256 bytes (heads over 128 in bf16, fp32 heads over 64) keep the 64x64 tile, whose q/K/V stages
# fit shared memory (228 KB on sm_90) at 512 bytes per row: 128x128 fp32 tiles of 128-wide heads need 256 KB.
WIDE_TILE = (128, 128, 8, 2)
NARROW_TILE = (64, 64, 4, 2)


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_m: int | None = None,
    tile: tuple[int, int, int, int] | None = None,
    host: tuple[list[int], list[int]] | None = None,
    scales: KVScales = None,
) -> torch.Tensor:
    """``tile = (BLOCK_M, BLOCK_N, num_warps, num_stages)`` overrides the default (GPU sweeps); ``block_m``
    alone overrides BLOCK_M. ``host``: ``query_start_loc`` and ``context_lens`` as host lists, which the engine
    has (without them the kernel's block plan reads both back from the device, a sync per call)."""
    tokens, hq, head_dim = q.shape
    hk, v_dim = k_cache.shape[2], v_cache.shape[-1]
    row_bytes = max(head_dim, v_dim) * q.element_size()
    bm, bn, warps, stages = tile or (WIDE_TILE if row_bytes <= 256 else NARROW_TILE)
    bm = block_m or bm
    out = torch.empty(tokens, hq, v_dim, dtype=q.dtype, device=q.device)
    starts, ctx = host if host is not None else (query_start_loc.tolist(), context_lens.tolist())
    plan = _block_plan(tuple(starts), tuple(ctx), bm, q.device)
    if plan is None:
        return out
    block_seqs, block_rows = plan
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    k_sc, v_sc = scales if scales is not None else (k_cache, v_cache)  # unread without scales
    _prefill_kernel[(hq, block_seqs.shape[0])](
        q,
        k_cache,
        v_cache,
        k_sc,
        v_sc,
        out,
        block_tables,
        block_seqs,
        block_rows,
        query_start_loc,
        context_lens,
        float(scale) * 1.4426950408889634,
        hq // hk,
        head_dim,
        v_dim,
        k_cache.shape[1],
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_sc.stride(0),
        k_sc.stride(1),
        k_sc.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_DV=max(16, next_pow2(v_dim)),
        PRECISION=precision,
        HAS_SCALES=scales is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@functools.lru_cache(maxsize=8)
def _block_plan(
    starts: tuple[int, ...], ctx: tuple[int, ...], bm: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's row blocks (sequence, first row) longest visible context first, as device tensors; None
    when there are no rows. Cached: every layer of a step asks for the same plan, and building it costs two
    host->device copies."""
    blocks = [
        (ctx[b] + row, b, row)
        for b in range(len(starts) - 1)
        for row in range(0, starts[b + 1] - starts[b], bm)
    ]
    if not blocks:
        return None
    blocks.sort(key=lambda item: -item[0])  # longest visible context first: causal work is uneven
    pinned = torch.tensor([[b for _, b, _ in blocks], [row for _, _, row in blocks]], dtype=torch.int32)
    if device.type == "cuda":
        pinned = pinned.pin_memory()
    plan = pinned.to(device, non_blocking=True)
    return plan[0], plan[1]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    host: tuple[list[int], list[int]] | None = None,
    scales: KVScales = None,
) -> torch.Tensor:
    """Causal varlen attention of new rows over the paged pool; Triton on CUDA, torch elsewhere. ``host``: the
    query starts and context lengths as host lists (``prefill_attention_triton``); ``scales``: an e4m3 pool's
    row scales."""
    if use_triton(q):
        return prefill_attention_triton(
            q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, host=host, scales=scales
        )
    return prefill_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, scales
    )
