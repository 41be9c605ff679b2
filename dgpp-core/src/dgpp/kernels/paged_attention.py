"""Paged decode attention: one query row per sequence against its K/V blocks (GQA, split context).

``q [B, Hq, D]``; ``k_cache [num_blocks, block_size, Hk, D]``, ``v_cache [.., Hk, Dv]``;
``block_tables [B, max_blocks]`` (int32); ``seq_lens [B]`` = tokens in the cache for each sequence,
the current one included (its K/V was written before the call). A row with ``seq_len == 0`` is a
padding row (CUDA-graph batch padding) and gets zeros. ``window > 0`` attends to the last
``window`` tokens only. Returns ``[B, Hq, Dv]`` in q's dtype. ``scales``: an e4m3 pool's fp32 row scales
``(k_scale, v_scale)``, each ``[num_blocks, block_size, Hk, 1]`` (``engine.kv_dtype: fp8``). The Triton kernel
applies them once per key: it dots the query with the exact codes, multiplies each score column by its key's K
scale and each probability column by its key's V scale before the P.V dot (``dgpp.kernels.kv_fp8``); the torch
reference attends over ``code * scale`` rounded to q's dtype.

The Triton path is flash-decoding: one program per (sequence, KV head, split) computes a partial
softmax for all query heads of the KV group (the group shares every K/V byte it loads), and a second
kernel merges the splits. The split count (the grid) depends only on the batch and table shapes, so a
captured graph keeps working as contexts grow. How a sequence's context is cut is decided on the device,
per sequence, from its own ``seq_len`` (no host sync, valid for any context at replay): its tokens are
spread evenly over the splits in ``BLOCK_N``-token steps, so a short context uses as many splits as it
has ``BLOCK_N`` chunks (not one long partition sized for the widest table), and a context of at most
``BLOCK_N`` tokens is done in one pass by split 0, which writes the output itself: no partials, and the
merge kernel leaves that row alone.

``positions [B, W]`` int32 with ``seq_lens`` as counts (``decode_attention_with_splits``): a row attends the
tokens its list names (the first ``seq_lens[b]`` entries, in list order) instead of ``0 .. seq_len - 1``, e.g. the
picks of a sparse-attention indexer; the list is split and merged as a context of that many tokens would be.

``sinks [Hq]`` (``decode_attention_with_splits``): one learned logit per query head that joins each row's
softmax and attends to nothing (Flint / MiMo full-attention layers). Split 0 starts its online softmax from
it (running max = the sink, running sum = 1), so it enters the merge exactly once however many splits the
row's context was cut into; a row done by split 0 alone includes it directly.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.kv_fp8 import (
    KVScales,
    dequantize_rows,
    e4m3_words,
    key_column_scales,
    lift_query,
    load_e4m3_lanes,
    tiles_in_columns,
    unlift_output,
    value_row_weights,
)
from dgpp.kernels.online_softmax import (
    merge_splits,
    normalized,
    probabilities,
    softmax_step,
    store_partials,
)

_MIN_PARTITION = 128  # tokens; below this the merge costs more than the parallelism gains
_BLOCK_N = 64  # tokens per inner step, and the granularity a sequence's context is split in
_TARGET_PROGRAMS = 1024  # enough programs to cover 132 SMs several times over
_MIN_DOT = 16  # the narrowest dot operand dimension Triton compiles for the tensor cores
# q/k and v widths (padded) from which a program runs on 8 warps: 256 + 256 (Qwen3.8-Flash-Next's QSA heads) on 4
# warps needs more than 255 registers a thread on sm_90 and spills (tests/perf/sass_paged_attention.py)
_WIDE_HEADS = 512


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    scales: KVScales = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, hq, _ = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, hq, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        first = max(0, n - window) if window > 0 else 0
        tok = torch.arange(first, n, device=q.device) if positions is None else positions[b, :n].long()
        phys = block_tables[b, tok // bs].long()
        k, v = k_cache[phys, tok % bs], v_cache[phys, tok % bs]
        if scales is not None:
            k = dequantize_rows(k, scales[0][phys, tok % bs], q.dtype)
            v = dequantize_rows(v, scales[1][phys, tok % bs], q.dtype)
        k = k.float().repeat_interleave(hq // hk, dim=1)  # [L, Hq, D]
        v = v.float().repeat_interleave(hq // hk, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def _sequence_split(seq_len, window, num_splits, BLOCK_N: tl.constexpr):
    """(first token, tokens per split, splits used) of one sequence: its attended span cut evenly into
    ``BLOCK_N`` multiples over at most ``num_splits`` splits."""
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    span = seq_len - first
    per_split = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    used = tl.cdiv(span, tl.maximum(per_split, 1))
    return first, per_split, used


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ksc_ptr,
    vsc_ptr,
    bt_ptr,
    lens_ptr,
    pos_ptr,
    sink_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale,
    window,
    group,
    head_dim,
    v_dim,
    num_splits,
    grid_splits,
    q_b,
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
    pos_b,
    o_b,
    o_h,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
):
    """Program ``(b, kvh, p)`` computes splits ``p, p + grid_splits, ...`` of its sequence: how the context
    is cut depends on ``seq_len`` and ``num_splits`` alone, how many programs share the work does not
    change any split's bits (``grid_splits <= num_splits`` trades parallelism for fewer programs)."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    first, per_split, used = _sequence_split(seq_len, window, num_splits, BLOCK_N)
    dtype: tl.constexpr = q_ptr.dtype.element_ty

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    heads = kvh * group + g
    gmask = g < group
    if HAS_SCALES:  # the query's columns 4w + i, one tile per i, lifted by an exact power of two (kv_fp8)
        qw = tl.arange(0, BLOCK_D // 4)
        q_rows = q_ptr + b * q_b + heads[:, None] * q_h + 4 * qw[None, :]
        q_live = gmask[:, None] & (4 * qw[None, :] < head_dim)
        q0 = lift_query(tl.load(q_rows, mask=q_live, other=0.0))
        q1 = lift_query(tl.load(q_rows + 1, mask=q_live, other=0.0))
        q2 = lift_query(tl.load(q_rows + 2, mask=q_live, other=0.0))
        q3 = lift_query(tl.load(q_rows + 3, mask=q_live, other=0.0))
    else:
        q = tl.load(
            q_ptr + b * q_b + heads[:, None] * q_h + d[None, :],
            mask=gmask[:, None] & (d[None, :] < head_dim),
            other=0.0,
        )
    omask = gmask[:, None] & (dv[None, :] < v_dim)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + heads, mask=gmask, other=0.0).to(tl.float32)
    # a padding row (seq_len 0) still runs split 0, which writes its zeros
    for split in range(tl.program_id(2), tl.maximum(used, 1), grid_splits):
        start = first + split * per_split
        end = tl.minimum(seq_len, start + per_split)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        if HAS_SINKS:  # split 0 alone starts from the sink logit: it joins the row's softmax once
            m_i = tl.where(split == 0, sink, m_i)
            l_i = tl.where(split == 0, 1.0, l_i)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        acc0 = tl.zeros([BLOCK_G, BLOCK_DV // 4], tl.float32)  # e4m3: output columns 4w + i, one tile per i
        acc1 = tl.zeros([BLOCK_G, BLOCK_DV // 4], tl.float32)
        acc2 = tl.zeros([BLOCK_G, BLOCK_DV // 4], tl.float32)
        acc3 = tl.zeros([BLOCK_G, BLOCK_DV // 4], tl.float32)
        for tok0 in range(start, end, BLOCK_N):
            toks = tok0 + tl.arange(0, BLOCK_N)
            tmask = toks < end
            if HAS_POSITIONS:  # the row's listed tokens (entries past its count are never loaded)
                toks = tl.load(pos_ptr + b * pos_b + toks, mask=tmask, other=0)
            phys = tl.load(bt_ptr + b * bt_b + toks // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            off = (toks % BLOCK_SIZE).to(tl.int64)
            k_rows = k_ptr + phys * k_blk + off * k_tok + kvh * k_head
            v_rows = v_ptr + phys * v_blk + off * v_tok + kvh * v_head
            # e4m3 rows: int32 words of four codes, each row's scale applied once per key (kv_fp8)
            if HAS_SCALES:
                sc_rows = phys * sc_blk + off * sc_tok + kvh * sc_head
                k0, k1, k2, k3 = load_e4m3_lanes(k_rows, tmask, head_dim // 4, dtype, BLOCK_D // 4, True)
                s = tl.dot(q0, k0, input_precision=PRECISION)
                s = tl.dot(q1, k1, s, input_precision=PRECISION)
                s = tl.dot(q2, k2, s, input_precision=PRECISION)
                s = tl.dot(q3, k3, s, input_precision=PRECISION)
                s = s * key_column_scales(ksc_ptr, sc_rows, tmask, scale, dtype)[None, :]
                s = tl.where(tmask[None, :], s, float("-inf"))
                v0, v1, v2, v3 = load_e4m3_lanes(v_rows, tmask, v_dim // 4, dtype, BLOCK_DV // 4, False)
                p, alpha, m_i, l_i = probabilities(s, m_i, l_i)
                p = (p * value_row_weights(vsc_ptr, sc_rows, tmask, dtype)[None, :]).to(dtype)
                acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=PRECISION)
                acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=PRECISION)
                acc2 = tl.dot(p, v2, acc2 * alpha[:, None], input_precision=PRECISION)
                acc3 = tl.dot(p, v3, acc3 * alpha[:, None], input_precision=PRECISION)
            else:
                kt = tl.load(
                    k_rows[None, :] + d[:, None], mask=tmask[None, :] & (d[:, None] < head_dim), other=0.0
                )
                s = tl.dot(q, kt, input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
                s = tl.where(tmask[None, :], s, float("-inf"))
                v = tl.load(
                    v_rows[:, None] + dv[None, :], mask=tmask[:, None] & (dv[None, :] < v_dim), other=0.0
                )
                acc, m_i, l_i = softmax_step(s, v, acc, m_i, l_i, PRECISION)
        if HAS_SCALES:
            acc = unlift_output(tiles_in_columns(acc0, acc1, acc2, acc3), dtype)
        # one split holds the whole context (or none: padding rows come out as zeros): split 0 is the answer
        direct = (split == 0) & (used <= 1)
        tl.store(
            out_ptr + b * o_b + heads[:, None] * o_h + dv[None, :],
            normalized(acc, l_i).to(out_ptr.dtype.element_ty),
            mask=omask & direct,
        )
        if not ONE_SPLIT:  # partials, written only when a merge follows
            partial = (used > 1) & (split < used)
            row = (b * group * tl.num_programs(1) + heads) * num_splits + split
            store_partials(
                part_acc_ptr, part_ml_ptr, row, acc, m_i, l_i, omask & partial, gmask & partial, BLOCK_DV
            )


@triton.jit
def _merge_partitions_kernel(
    part_acc_ptr,
    part_ml_ptr,
    lens_ptr,
    out_ptr,
    v_dim,
    num_heads,
    num_splits,
    window,
    o_b,
    o_h,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    _first, _per_split, used = _sequence_split(seq_len, window, num_splits, BLOCK_N)
    if used > 1:  # a one-split row was written by the partition kernel itself
        first = (b * num_heads + h) * num_splits
        merge_splits(
            part_acc_ptr, part_ml_ptr, out_ptr + b * o_b + h * o_h, first, used, v_dim, BLOCK_S, BLOCK_DV
        )


def programs_per_row(batch: int, kv_heads: int) -> int:
    """Split programs per (sequence, KV head) that cover the GPU several times over (``_TARGET_PROGRAMS``)."""
    return max(1, _TARGET_PROGRAMS // max(1, batch * kv_heads))


def plan_partition(
    batch: int, kv_heads: int, max_context: int, min_partition: int = _MIN_PARTITION
) -> tuple[int, int]:
    """(partition tokens, splits) for the widest context the table allows: split long contexts only while
    the grid is too small for the GPU. The splits size the grid; each sequence then spreads its own
    context over them (see the module docstring), so the partition is an upper bound per split."""
    want = programs_per_row(batch, kv_heads)
    splits = max(1, min(want, triton.cdiv(max_context, min_partition)))
    partition = next_pow2(triton.cdiv(max_context, splits))
    partition = max(partition, 64)
    return partition, triton.cdiv(max_context, partition)


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    min_partition: int = _MIN_PARTITION,
    scales: KVScales = None,
) -> torch.Tensor:
    """``min_partition`` (tokens) bounds the split count for short tables (check_kernels times 64 vs 128)."""
    _partition, splits = plan_partition(
        q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], min_partition
    )
    return decode_attention_with_splits(
        q, k_cache, v_cache, block_tables, seq_lens, scale, window, splits, scales=scales
    )


def decode_attention_with_splits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    splits: int,
    grid_splits: int | None = None,
    scales: KVScales = None,
    sinks: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton decode attention with each sequence's context spread over ``splits`` splits (the merge
    runs only when ``splits > 1``), computed by ``grid_splits`` (default ``splits``) programs per
    (sequence, KV head): fewer programs when the batch alone fills the GPU, with the same bits. ``sinks``:
    per-head sink logits ``[Hq]``; ``positions``: per-row token lists, ``seq_lens`` their counts (see the
    module docstring)."""
    batch, hq, head_dim = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    v_dim = v_cache.shape[-1]
    group = hq // hk
    out = torch.empty(batch, hq, v_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_d, block_dv = next_pow2(head_dim), next_pow2(v_dim)
    if (
        scales is not None
    ):  # e4m3: a quarter of each is a dot's width (K of the scores, N of the output), >= 16
        block_d, block_dv = max(block_d, 4 * _MIN_DOT), max(block_dv, 4 * _MIN_DOT)
    if splits > 1:
        part_acc = torch.empty(batch, hq, splits, block_dv, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, hq, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid_splits = max(1, min(grid_splits or splits, splits))
    k_sc, v_sc = scales if scales is not None else (k_cache, v_cache)  # unread without scales
    if scales is not None:
        k_cache, v_cache = e4m3_words(k_cache), e4m3_words(v_cache)
    _decode_partition_kernel[(batch, hk, grid_splits)](
        q,
        k_cache,
        v_cache,
        k_sc,
        v_sc,
        block_tables,
        seq_lens,
        positions if positions is not None else seq_lens,  # unread without positions
        sinks if sinks is not None else q,  # unread without sinks
        out,
        part_acc,
        part_ml,
        float(scale),
        int(window),
        group,
        head_dim,
        v_dim,
        splits,
        grid_splits,
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
        0 if positions is None else positions.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_N=_BLOCK_N,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_SIZE=block_size,
        ONE_SPLIT=splits == 1,
        PRECISION=precision,
        HAS_SCALES=scales is not None,
        HAS_SINKS=sinks is not None,
        HAS_POSITIONS=positions is not None,
        num_warps=8 if block_d + block_dv >= _WIDE_HEADS else 4,
    )
    if splits > 1:
        _merge_partitions_kernel[(batch, hq)](
            part_acc,
            part_ml,
            seq_lens,
            out,
            v_dim,
            hq,
            splits,
            int(window),
            out.stride(0),
            out.stride(1),
            BLOCK_N=_BLOCK_N,
            BLOCK_S=next_pow2(splits),
            BLOCK_DV=block_dv,
            num_warps=4,
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    scales: KVScales = None,
) -> torch.Tensor:
    """Decode attention over paged K/V; Triton on CUDA, torch elsewhere."""
    if use_triton(q):
        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, scale, window, scales=scales
        )
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, window, scales)
