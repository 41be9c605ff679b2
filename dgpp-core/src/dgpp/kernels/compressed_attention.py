"""Compressed sink attention for prefill / extend rows (DeepSeek-V4's CSA and HCA layers): one softmax per row
and head over the row's sliding window, its compressed entries and the head's sink logit, with one shared
latent head read as both K and V.

``q [T, H, D]`` holds this step's rows of every sequence (``query_start_loc [B+1]``); sequence ``b``'s rows sit
at positions ``context_lens[b] ..``. A row at position ``p`` attends to:

- the window ``max(0, p - window + 1) .. p``: positions before the step from the request's ring
  ``[slots, R, 1, D]`` (position ``j`` at ``j % R``, slot ``state_slots[b]``), the rest from this step's latent
  rows ``kv [T, D]``;
- its entries: the first ``entry_count[r]`` rows of ``entry_rows[r]`` (flat rows of the compressed pool
  ``[N, D]``): every complete window's entry (HCA) or the indexer's picks (CSA), whichever the caller lists;
- the sink ``sinks[h]``: one more logit that attends to nothing.

The Triton kernel gives one program to each (row, block of heads): it walks the window's keys, then the
entries, in ``BLOCK_N`` tiles with an online softmax seeded by the sink; the tiles depend on the row's position
and its entry list alone, so a row has the same bits however its prompt was chunked or batched. The torch
form (CPU) computes the same math batched: rows with the same number of window keys and entries form one
batch of per-row products (``per_row_bmm``), each row the product the per-row reference
(``dgpp.nn.compressed_attention.sparse_window_attention_ref``) computes. A padding row (``seq_lens == 0`` or
state slot -1) gets zeros.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.window_attention import row_sequences

# A 512-wide latent under 64 heads: 16 heads x 16 keys per tile keeps the [heads, D] query, the [keys, D] tile
# and the fp32 accumulator in registers (as ``dgpp.kernels.window_attention``'s wide-head tiles).
_WIDE_HEAD = 256


# torch's CPU bmm multiplies products of fewer multiply-adds than this with a plain loop of its own, whose sums
# round differently from the GEMM ``torch.mm`` always takes
_BMM_NAIVE_BELOW = 400


def per_row_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[i] @ b[i]`` for every ``i`` (``[n, m, k] x [n, k, p]``), each with the bits ``torch.mm`` gives it alone:
    one ``torch.bmm`` call, or one ``mm`` per product where bmm would take its small-product loop (CPU)."""
    if a.device.type == "cpu" and a.shape[1] * a.shape[2] * b.shape[2] < _BMM_NAIVE_BELOW:
        return torch.stack([x @ y for x, y in zip(a, b, strict=True)])
    return torch.bmm(a, b)


def _tiles(heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_G) for this head shape: a function of the shapes alone."""
    if head_dim > _WIDE_HEAD:
        return 16, 16
    return 32, min(64, max(16, next_pow2(heads)))


def _row_layout(
    rows: int,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, ...]:
    """Per row: (sequence, position, first window position, live) on the device."""
    seq = row_sequences(query_start_loc, rows).long()
    index = torch.arange(rows, device=query_start_loc.device)
    pos = context_lens.long()[seq] + index - query_start_loc.long()[seq]
    live = (seq_lens[seq] > 0) & (state_slots[seq] >= 0)
    return seq, pos, (pos - window + 1).clamp(min=0), live


def compressed_attention_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    pool: torch.Tensor,
    entry_rows: torch.Tensor,
    entry_count: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """fp32 math, rows batched by their key counts (one host sync per distinct count)."""
    rows, dim = q.shape[0], q.shape[-1]
    out = torch.zeros_like(q)
    if rows == 0:
        return out
    cap = max(1, ring.shape[1])
    seq, pos, lo, live = _row_layout(rows, query_start_loc, context_lens, seq_lens, state_slots, window)
    n_win = torch.where(live, pos - lo + 1, 0)
    n_ent = torch.where(live, entry_count.long(), 0)
    wpos = lo[:, None] + torch.arange(max(1, window), device=q.device)[None]
    ctx = context_lens.long()[seq][:, None]
    from_ring = wpos < ctx
    ring_idx = state_slots.long()[seq].clamp(min=0)[:, None] * cap + wpos % cap
    step_idx = (query_start_loc.long()[seq][:, None] + wpos - ctx).clamp(0, rows - 1)
    ring_flat, pool_flat = ring.reshape(-1, dim), pool.reshape(-1, dim)
    width = entry_rows.shape[1] + 1
    group = n_win * width + n_ent
    sink_col = sinks.float()[None, :, None]
    for value in torch.unique(group[live]).tolist():
        sel = torch.nonzero(live & (group == value)).flatten()
        nw, ne = divmod(int(value), width)
        win = torch.where(
            from_ring[sel, :nw, None],
            ring_flat[ring_idx[sel, :nw]].to(kv.dtype),
            kv[step_idx[sel, :nw]],
        )
        keys = torch.cat([win, pool_flat[entry_rows[sel, :ne].long()].to(kv.dtype)], dim=1).float()
        scores = per_row_bmm(q[sel].float(), keys.transpose(1, 2)) * scale  # [G, H, L]
        scores = torch.cat([scores, sink_col.expand(sel.shape[0], -1, 1)], dim=2)
        probs = scores.softmax(dim=-1)[..., :-1]
        out[sel] = per_row_bmm(probs, keys).to(q.dtype)
    return out


@triton.jit
def _attend_tile(q, k, valid, acc, m_i, l_i, scale, PRECISION: tl.constexpr):
    """One online-softmax step over the keys ``k [BLOCK_N, D]`` (K read as V) where ``valid``."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _compressed_attention_kernel(
    q_ptr,
    kv_ptr,
    ring_ptr,
    pool_ptr,
    ent_ptr,
    cnt_ptr,
    row_seq_ptr,
    qsl_ptr,
    ctx_ptr,
    lens_ptr,
    slots_ptr,
    sink_ptr,
    out_ptr,
    scale,
    window,
    heads,
    dim,
    cap,
    q_t,
    q_h,
    kv_t,
    ring_s,
    ring_p,
    pool_r,
    ent_t,
    o_t,
    o_h,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    hg = tl.program_id(1)
    b = tl.load(row_seq_ptr + r).to(tl.int64)
    start = tl.load(qsl_ptr + b).to(tl.int64)
    ctx = tl.load(ctx_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = (tl.load(lens_ptr + b) > 0) & (slot >= 0)
    pos = ctx + (r - start)
    lo = tl.maximum(pos - window + 1, 0)
    hi = tl.where(live, pos + 1, lo)  # a padding row walks no keys
    n_ent = tl.where(live, tl.load(cnt_ptr + r), 0)

    g = hg * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < heads
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    q = tl.load(
        q_ptr + r * q_t + g[:, None] * q_h + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0
    )
    # the sink is one more logit: it seeds the running max and adds exp(sink - m) to the sum
    m_i = tl.load(sink_ptr + g, mask=gmask, other=0.0).to(tl.float32)
    l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tok0 in range(lo, hi, BLOCK_N):  # the window: before the step from the ring, then this step's rows
        toks = tok0 + tl.arange(0, BLOCK_N)
        tmask = toks < hi
        old = toks < ctx
        ring_rows = ring_ptr + slot * ring_s + (toks % cap) * ring_p
        k = tl.load(ring_rows[:, None] + d[None, :], mask=(tmask & old)[:, None] & dmask[None, :], other=0.0)
        k = k.to(q.dtype)
        step_rows = kv_ptr + (start + toks - ctx) * kv_t
        k += tl.load(
            step_rows[:, None] + d[None, :], mask=(tmask & ~old)[:, None] & dmask[None, :], other=0.0
        )
        acc, m_i, l_i = _attend_tile(q, k, tmask, acc, m_i, l_i, scale, PRECISION)
    for e0 in range(0, n_ent, BLOCK_N):  # the row's entries, in its list's order
        idx = e0 + tl.arange(0, BLOCK_N)
        emask = idx < n_ent
        rows = tl.load(ent_ptr + r * ent_t + idx, mask=emask, other=0).to(tl.int64)
        k = tl.load(
            pool_ptr + rows[:, None] * pool_r + d[None, :], mask=emask[:, None] & dmask[None, :], other=0.0
        )
        acc, m_i, l_i = _attend_tile(q, k.to(q.dtype), emask, acc, m_i, l_i, scale, PRECISION)
    out = tl.where(live, acc / l_i[:, None], 0.0)
    tl.store(
        out_ptr + r * o_t + g[:, None] * o_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=gmask[:, None] & dmask[None, :],
    )


def compressed_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    pool: torch.Tensor,
    entry_rows: torch.Tensor,
    entry_count: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    rows, heads, dim = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    block_n, block_g = _tiles(heads, dim)
    pool_flat = pool.reshape(-1, dim)
    if entry_rows.shape[1] == 0:  # no entries anywhere: the kernel still wants a row stride
        entry_rows = entry_count.new_zeros(rows, 1)
    _compressed_attention_kernel[(rows, triton.cdiv(heads, block_g))](
        q,
        kv,
        ring,
        pool_flat,
        entry_rows,
        entry_count,
        row_sequences(query_start_loc, rows),
        query_start_loc,
        context_lens,
        seq_lens,
        state_slots,
        sinks.float(),
        out,
        float(scale),
        int(window),
        heads,
        dim,
        max(1, ring.shape[1]),
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        ring.stride(0),
        ring.stride(1),
        pool_flat.stride(0),
        entry_rows.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_N=block_n,
        BLOCK_G=block_g,
        BLOCK_D=max(16, next_pow2(dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def compressed_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    pool: torch.Tensor,
    entry_rows: torch.Tensor,
    entry_count: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """``[T, H, D]``: Triton on CUDA, the batched torch form elsewhere (same arguments as the module says)."""
    fn = compressed_attention_triton if use_triton(q) else compressed_attention_torch
    return fn(
        q,
        kv,
        ring,
        pool,
        entry_rows,
        entry_count,
        query_start_loc,
        context_lens,
        seq_lens,
        state_slots,
        sinks,
        scale,
        window,
    )
