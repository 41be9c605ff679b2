"""Attention with per-head sink logits, optionally over a sliding window, for prefill and decode rows alike.

``q [T, Hq, D]`` holds this step's rows of every sequence (``query_start_loc [B+1]``); sequence ``b``'s rows sit
at positions ``context_lens[b] ..``. A row at position ``p`` attends to keys ``lo .. p`` with ``lo = p - window + 1``
(clamped at 0; ``window = 0``: the whole context) plus, when ``sinks [Hq]`` is given, one extra logit per head
that joins the softmax and attends to nothing (gpt-oss / Flint / MiMo attention sinks). The keys come from one
of two sources:

- ``paged``: the engine's paged pool ``[num_blocks, block_size, Hk, D]`` through ``block_tables`` (this step's
  K/V already written), for full-attention layers;
- ring: a per-request ring ``[slots, R, Hk, D]`` of the ``R`` positions before this step (position ``j`` at index
  ``j % R``), selected by ``state_slots``, then this step's own rows ``k``/``v``. ``R = window - 1`` is all a
  row needs, so the ring bounds a sliding layer's cache at ``window - 1`` tokens per request whatever the
  context. ``dgpp.kernels.ring_write`` stores the last ``R`` positions of each sequence after the attention read
  them.

The Triton kernel gives one program to each (row, KV head): it walks the row's keys in ``BLOCK_N`` tiles that
start at ``lo`` (a function of the row's position alone), with an online softmax seeded by the sink. Which
source a key comes from does not change its bits, so a row's output is the same however the prompt was
chunked, batched or restored from a prefix-cache snapshot. A padding row (``seq_lens == 0`` or state slot -1)
gets zeros and writes nothing.
A full-attention layer's decode rows, whose span is the whole context, take the split-context kernel instead
(``dgpp.nn.paged_sink_attention``); its prefill rows come here.

``scales``: the source's fp32 row scales ``(k_scale, v_scale)`` when it holds e4m3 rows
(``engine.kv_dtype: fp8``; pool ``[num_blocks, block_size, Hk, 1]``, ring ``[slots, R, Hk, 1]``). Each loaded
tile is dequantized once, ``code * scale`` rounded to q's dtype (``dgpp.kernels.kv_fp8``). A ring layer's caller
hands this step's own rows already round-tripped through e4m3, so a key has the same value whether it is read
from the ring or from the step.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.kv_fp8 import KVScales, dequantize_rows, e4m3_words, load_e4m3_rows
from dgpp.kernels.online_softmax import normalized, softmax_step

_BLOCK_N = 64
# One program holds a [BLOCK_G, BLOCK_D] query tile, [BLOCK_D, BLOCK_N] keys and a [BLOCK_G, BLOCK_DV] fp32
# accumulator. Wide heads (DeepSeek-V4's 512-wide shared K/V head under 64 query heads) overflow the SM's 227 KB
# of shared memory and the register file at 64 heads x 64 keys, so they take fewer keys per tile and split the
# query heads of one KV head over several programs. Both are functions of the shapes alone: a row's bits still
# do not depend on how its prompt was chunked or batched.
_WIDE_HEAD = 256
_WIDE_BLOCK_N = 16
_WIDE_MAX_G = 16


def narrow_heads(head_dim: int, v_dim: int) -> bool:
    """Heads whose tiles take ``_BLOCK_N`` keys and a KV head's whole query group in one program."""
    return max(head_dim, v_dim) <= _WIDE_HEAD


def head_tiles(group: int, head_dim: int, v_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_G, head groups per KV head) for this head shape."""
    block_g = max(16, next_pow2(group))
    if narrow_heads(head_dim, v_dim):
        return _BLOCK_N, block_g, 1
    block_g = min(block_g, _WIDE_MAX_G)
    return _WIDE_BLOCK_N, block_g, triton.cdiv(group, block_g)


def row_sequences(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The sequence each of the ``num_rows`` flattened rows belongs to (on the device, no host sync)."""
    rows = torch.arange(num_rows, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True)


def _source_rows(
    src: torch.Tensor, scale: torch.Tensor | None, index: tuple, dtype: torch.dtype
) -> torch.Tensor:
    return src[index] if scale is None else dequantize_rows(src[index], scale[index], dtype)


def _key_rows(src_k, src_v, loc, b, ctx, start, positions, k, v, paged: bool, scales: KVScales, dtype):
    """K/V rows ``[L, Hk, D]`` of sequence ``b`` at ``positions`` (reference helper)."""
    k_sc, v_sc = scales if scales is not None else (None, None)
    if paged:
        bs = src_k.shape[1]
        index = (loc[b, positions // bs].long(), positions % bs)
        return _source_rows(src_k, k_sc, index, dtype), _source_rows(src_v, v_sc, index, dtype)
    ring = src_k.shape[1]
    slot = int(loc[b])
    old = positions < ctx
    index = (slot, positions[old] % ring)
    idx_new = start + positions[~old] - ctx
    return (
        torch.cat([_source_rows(src_k, k_sc, index, dtype), k[idx_new]]),
        torch.cat([_source_rows(src_v, v_sc, index, dtype), v[idx_new]]),
    )


def window_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    loc: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    window: int,
    paged: bool,
    scales: KVScales = None,
) -> torch.Tensor:
    """fp32 reference of the kernel (a loop over rows); ``loc`` is ``block_tables`` (paged) or ``state_slots``."""
    hq, hk = q.shape[1], src_k.shape[2]
    out = torch.zeros(q.shape[0], hq, src_v.shape[-1], dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for b, (ctx, n) in enumerate(zip(context_lens.tolist(), seq_lens.tolist(), strict=True)):
        if n == 0 or (not paged and int(loc[b]) < 0):
            continue
        for r in range(starts[b], starts[b + 1]):
            pos = ctx + r - starts[b]
            lo = max(0, pos - window + 1) if window > 0 else 0
            keys, vals = _key_rows(
                src_k,
                src_v,
                loc,
                b,
                ctx,
                starts[b],
                torch.arange(lo, pos + 1, device=q.device),
                k,
                v,
                paged,
                scales,
                q.dtype,
            )
            keys = keys.float().repeat_interleave(hq // hk, dim=1)
            vals = vals.float().repeat_interleave(hq // hk, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[r].float(), keys) * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
            probs = scores.softmax(-1)[:, : keys.shape[0]]
            out[r] = torch.einsum("hl,lhd->hd", probs, vals).to(q.dtype)
    return out


@triton.jit
def load_paged_tile(
    sources,
    table_ptr,
    kvh,
    toks,
    tmask,
    cap,
    dims,
    strides,
    dtype: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    """The key tile ``[BLOCK_D, N]`` and value tile ``[N, BLOCK_DV]`` of positions ``toks`` (zeros where not
    ``tmask``) from the paged pool through one sequence's block table ``table_ptr``. ``sources``: the K and V
    pools and their row scales; ``dims``: (head_dim, v_dim); ``strides``: the pools' three, then the scales'."""
    ks_ptr, vs_ptr, ksc_ptr, vsc_ptr = sources
    head_dim, v_dim = dims
    ks_0, ks_1, ks_2, vs_0, vs_1, vs_2, sc_0, sc_1, sc_2 = strides
    phys = tl.load(table_ptr + toks // cap, mask=tmask, other=0).to(tl.int64)
    k_rows = ks_ptr + phys * ks_0 + (toks % cap) * ks_1 + kvh * ks_2
    v_rows = vs_ptr + phys * vs_0 + (toks % cap) * vs_1 + kvh * vs_2
    if HAS_SCALES:  # e4m3 rows (int32 words of four codes): code * row scale, rounded to q's dtype
        sc_rows = phys * sc_0 + (toks % cap) * sc_1 + kvh * sc_2
        kt = load_e4m3_rows(k_rows, ksc_ptr, sc_rows, tmask, head_dim // 4, dtype, BLOCK_D // 4, True)
        v = load_e4m3_rows(v_rows, vsc_ptr, sc_rows, tmask, v_dim // 4, dtype, BLOCK_DV // 4, False)
    else:
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        kt = tl.load(k_rows[None, :] + d[:, None], mask=tmask[None, :] & (d[:, None] < head_dim), other=0.0)
        v = tl.load(v_rows[:, None] + dv[None, :], mask=tmask[:, None] & (dv[None, :] < v_dim), other=0.0)
    return kt, v


@triton.jit
def _window_attention_kernel(
    q_ptr,
    kn_ptr,
    vn_ptr,
    ks_ptr,
    vs_ptr,
    ksc_ptr,
    vsc_ptr,
    loc_ptr,
    row_seq_ptr,
    qsl_ptr,
    ctx_ptr,
    lens_ptr,
    sink_ptr,
    out_ptr,
    scale,
    window,
    group,
    head_dim,
    v_dim,
    cap,
    q_t,
    q_h,
    kn_t,
    kn_h,
    vn_t,
    vn_h,
    ks_0,
    ks_1,
    ks_2,
    vs_0,
    vs_1,
    vs_2,
    sc_0,
    sc_1,
    sc_2,
    loc_b,
    o_t,
    o_h,
    PAGED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    hg = tl.program_id(2)  # which BLOCK_G heads of this KV head's group
    b = tl.load(row_seq_ptr + r).to(tl.int64)
    start = tl.load(qsl_ptr + b).to(tl.int64)
    ctx = tl.load(ctx_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    if PAGED:
        live = seq_len > 0
        slot = b * 0
    else:
        slot = tl.load(loc_ptr + b).to(tl.int64)
        live = (seq_len > 0) & (slot >= 0)
    pos = ctx + (r - start)
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    hi = tl.where(live, pos + 1, lo)  # a padding row walks no keys

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    heads = kvh * group + hg * BLOCK_G + g
    gmask = hg * BLOCK_G + g < group
    q = tl.load(
        q_ptr + r * q_t + heads[:, None] * q_h + d[None, :],
        mask=gmask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    if HAS_SINKS:  # the sink is one more logit: it seeds the running max and adds exp(sink - m) to the sum
        m_i = tl.load(sink_ptr + heads, mask=gmask, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for tok0 in range(lo, hi, BLOCK_N):
        toks = tok0 + tl.arange(0, BLOCK_N)
        tmask = toks < hi
        if PAGED:
            kt, v = load_paged_tile(
                (ks_ptr, vs_ptr, ksc_ptr, vsc_ptr),
                loc_ptr + b * loc_b,
                kvh,
                toks,
                tmask,
                cap,
                (head_dim, v_dim),
                (ks_0, ks_1, ks_2, vs_0, vs_1, vs_2, sc_0, sc_1, sc_2),
                q.dtype,
                BLOCK_D,
                BLOCK_DV,
                HAS_SCALES,
            )
        else:  # positions before this step from the ring, the rest from this step's rows
            old = toks < ctx
            ring = toks % cap
            fresh = start + toks - ctx
            kr = ks_ptr + slot * ks_0 + ring * ks_1 + kvh * ks_2
            kf = kn_ptr + fresh * kn_t + kvh * kn_h
            vr = vs_ptr + slot * vs_0 + ring * vs_1 + kvh * vs_2
            vf = vn_ptr + fresh * vn_t + kvh * vn_h
            if HAS_SCALES:  # the ring's e4m3 rows (words); this step's rows come round-tripped already
                sc_rows = slot * sc_0 + ring * sc_1 + kvh * sc_2
                ring_rows = tmask & old
                kt = load_e4m3_rows(
                    kr, ksc_ptr, sc_rows, ring_rows, head_dim // 4, q.dtype, BLOCK_D // 4, True
                )
                v = load_e4m3_rows(vr, vsc_ptr, sc_rows, ring_rows, v_dim // 4, q.dtype, BLOCK_DV // 4, False)
            else:
                kt = tl.load(
                    kr[None, :] + d[:, None], mask=(tmask & old)[None, :] & (d[:, None] < head_dim), other=0.0
                )
                v = tl.load(
                    vr[:, None] + dv[None, :], mask=(tmask & old)[:, None] & (dv[None, :] < v_dim), other=0.0
                )
            kt += tl.load(
                kf[None, :] + d[:, None], mask=(tmask & ~old)[None, :] & (d[:, None] < head_dim), other=0.0
            )
            v += tl.load(
                vf[:, None] + dv[None, :], mask=(tmask & ~old)[:, None] & (dv[None, :] < v_dim), other=0.0
            )
        s = tl.dot(q, kt, input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(tmask[None, :], s, float("-inf"))
        acc, m_i, l_i = softmax_step(s, v, acc, m_i, l_i, PRECISION)
    out = tl.where(live, normalized(acc, l_i), 0.0)
    tl.store(
        out_ptr + r * o_t + heads[:, None] * o_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=gmask[:, None] & (dv[None, :] < v_dim),
    )


def window_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    loc: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    window: int,
    paged: bool,
    scales: KVScales = None,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    rows, hq, head_dim = q.shape
    hk, v_dim = src_k.shape[2], src_v.shape[-1]
    out = torch.empty(rows, hq, v_dim, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    kn = k if k is not None else q  # unused by the paged source
    vn = v if v is not None else q
    row_seq = row_sequences(query_start_loc, rows) if row_seq is None else row_seq
    group = hq // hk
    block_n, block_g, head_groups = head_tiles(group, head_dim, v_dim)
    k_sc, v_sc = scales if scales is not None else (src_k, src_v)  # unread without scales
    if scales is not None:
        src_k, src_v = e4m3_words(src_k), e4m3_words(src_v)
    _window_attention_kernel[(rows, hk, head_groups)](
        q,
        kn,
        vn,
        src_k,
        src_v,
        k_sc,
        v_sc,
        loc,
        row_seq,
        query_start_loc,
        context_lens,
        seq_lens,
        sinks if sinks is not None else q,
        out,
        float(scale),
        int(window),
        group,
        head_dim,
        v_dim,
        src_k.shape[1],
        q.stride(0),
        q.stride(1),
        kn.stride(0),
        kn.stride(1),
        vn.stride(0),
        vn.stride(1),
        src_k.stride(0),
        src_k.stride(1),
        src_k.stride(2),
        src_v.stride(0),
        src_v.stride(1),
        src_v.stride(2),
        k_sc.stride(0),
        k_sc.stride(1),
        k_sc.stride(2),
        loc.stride(0),
        out.stride(0),
        out.stride(1),
        PAGED=paged,
        HAS_SINKS=sinks is not None,
        BLOCK_N=block_n,
        BLOCK_G=block_g,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_DV=next_pow2(v_dim),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SCALES=scales is not None,
        num_warps=4,
    )
    return out


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    loc: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    window: int,
    paged: bool,
    scales: KVScales = None,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sink (and window) attention; Triton on CUDA, the torch reference elsewhere. ``row_seq``: the step's
    ``row_sequences``, when the caller keeps them for every layer of the step."""
    args = (
        q,
        k,
        v,
        src_k,
        src_v,
        loc,
        query_start_loc,
        context_lens,
        seq_lens,
        sinks,
        scale,
        window,
        paged,
        scales,
    )
    if use_triton(q):
        return window_attention_triton(*args, row_seq=row_seq)
    return window_attention_ref(*args)
