"""Gated DeltaNet kernels: the recurrent decode step and the chunked prefill, on the pooled fp32 state.

Shapes (flattened varlen rows): ``q, k [T, Hk, dk]``, ``v [T, Hv, dv]``, ``beta [T, Hv]``, ``g`` the log decay
(<= 0) per head ``[T, Hv]`` (GDN) or per head and key channel ``[T, Hv, dk]`` (Kimi delta attention, whose
``S <- diag(exp(g)) S`` decays each key row of the state on its own; decode and the reference only); ``state_pool [slots, Hv, dk, dv]`` fp32, read at ``state_slots[b]`` (zeros where
``fresh[b]``) and written back in place; a slot of -1 marks a padding row (no read, no write).
Value head ``j`` reads key head ``j // (Hv / Hk)``. q and k are L2-normalised inside (eps 1e-6) and q
is scaled by ``dk^-1/2``. Per token: ``S <- exp(g) S``; ``S <- S + k (beta (v - S^T k))^T``; ``o = S^T q``.
Outputs are fp32 ``[T, Hv, dv]``.

Decode: one program per (sequence, value head, dv block) keeps its ``[dk, BV]`` state tile in
registers for the step. Prefill: the same tiling walks its sequence chunk by chunk; inside a chunk
the UT transform ``(I + A)^-1`` (A strictly lower, ``A_ij = beta_i k_i.k_j exp(G_i - G_j)``) is built
by forward substitution and applied with matrix products, so only the chunk-to-chunk hand-off of
the state is sequential.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton


def _l2n(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """Token-by-token recurrence (the definition); covers decode and prefill alike."""
    hv, hk = v.shape[1], k.shape[1]
    group = hv // hk
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    starts = query_start_loc.tolist()
    for b, slot in enumerate(state_slots.tolist()):
        if slot < 0:
            continue
        state = torch.zeros_like(state_pool[slot]) if bool(fresh[b]) else state_pool[slot].float().clone()
        for t in range(starts[b], starts[b + 1]):
            qt = _l2n(q[t].float()).repeat_interleave(group, 0) * q.shape[-1] ** -0.5
            kt = _l2n(k[t].float()).repeat_interleave(group, 0)
            decay = g[t].float().exp()
            state = state * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
            correction = (v[t].float() - torch.einsum("hkv,hk->hv", state, kt)) * beta[t].float()[:, None]
            state = state + kt[:, :, None] * correction[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, qt)
        state_pool[slot] = state.to(state_pool.dtype)
    return out


@triton.jit
def l2_factor(x, scale):
    """``scale / sqrt(sum x^2 + eps)`` over the last dim (kept): what L2-normalises (and scales) each row of x."""
    return tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6) * scale


@triton.jit
def load_normed(ptr, row_off, dims, dk, valid, scale):
    x = tl.load(ptr + row_off + dims, mask=valid & (dims < dk), other=0.0).to(tl.float32)
    return x * l2_factor(x, scale)


@triton.jit
def unit_lower_inverse(a, C: tl.constexpr):
    """``(I + a)^-1`` of a strictly lower ``[C, C]`` tile by forward substitution: row i = e_i - sum_{j<i} a_ij
    row_j, rows j < i already final."""
    r = tl.arange(0, C)
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)
        row = tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(r[:, None] == i, inv - row[None, :], inv)
    return inv


@triton.jit
def _gdn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    pool_ptr,
    slots_ptr,
    fresh_ptr,
    out_ptr,
    group,
    dk,
    dv,
    q_t,
    q_h,
    k_t,
    k_h,
    v_t,
    v_h,
    g_t,
    b_t,
    p_slot,
    p_head,
    o_t,
    o_h,
    scale,
    g_h,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vcol = tl.program_id(2) * BV + tl.arange(0, BV)
    krow = tl.arange(0, BK)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot >= 0
    vmask = vcol < dv
    kh = h // group
    qv = load_normed(q_ptr, b * q_t + kh * q_h, krow, dk, live, scale)
    kv = load_normed(k_ptr, b * k_t + kh * k_h, krow, dk, live, 1.0)
    val = tl.load(v_ptr + b * v_t + h * v_h + vcol, mask=live & vmask, other=0.0).to(tl.float32)
    if PER_CHANNEL:  # one factor per key row of the state
        g_row = tl.load(g_ptr + b * g_t + h * g_h + krow, mask=live & (krow < dk), other=0.0)
        decay = tl.exp(g_row.to(tl.float32))[:, None]
    else:
        decay = tl.exp(tl.load(g_ptr + b * g_t + h * g_h, mask=live, other=0.0).to(tl.float32))
    beta = tl.load(beta_ptr + b * b_t + h, mask=live, other=0.0).to(tl.float32)
    smask = live & (krow[:, None] < dk) & vmask[None, :]
    s_ptrs = pool_ptr + slot * p_slot + h * p_head + krow[:, None] * dv + vcol[None, :]
    keep_old = tl.load(fresh_ptr + b, mask=live, other=1) == 0
    state = tl.load(s_ptrs, mask=smask & keep_old, other=0.0) * decay
    correction = (val - tl.sum(state * kv[:, None], axis=0)) * beta
    state += kv[:, None] * correction[None, :]
    tl.store(s_ptrs, state, mask=smask)
    tl.store(out_ptr + b * o_t + h * o_h + vcol, tl.sum(state * qv[:, None], axis=0), mask=vmask)


@triton.jit
def _gdn_chunk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    pool_ptr,
    slots_ptr,
    fresh_ptr,
    starts_ptr,
    out_ptr,
    group,
    dk,
    dv,
    q_t,
    q_h,
    k_t,
    k_h,
    v_t,
    v_h,
    g_t,
    b_t,
    p_slot,
    p_head,
    o_t,
    o_h,
    scale,
    g_h,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vcol = tl.program_id(2) * BV + tl.arange(0, BV)
    krow = tl.arange(0, BK)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot >= 0
    first = tl.load(starts_ptr + b).to(tl.int64)
    last = tl.load(starts_ptr + b + 1).to(tl.int64)
    last = tl.where(live, last, first)  # padding rows: no tokens
    vmask = vcol < dv
    kh = h // group
    smask = live & (krow[:, None] < dk) & vmask[None, :]
    s_ptrs = pool_ptr + slot * p_slot + h * p_head + krow[:, None] * dv + vcol[None, :]
    keep_old = tl.load(fresh_ptr + b, mask=live, other=1) == 0
    state = tl.load(s_ptrs, mask=smask & keep_old, other=0.0)

    r = tl.arange(0, C)
    lower_incl = r[:, None] >= r[None, :]
    for c0 in range(first, last, C):
        t = c0 + r
        valid = t < last
        # invalid rows carry k = v = beta = g = 0: they neither change the state nor the solve
        qc = load_normed(q_ptr, t[:, None] * q_t + kh * q_h, krow[None, :], dk, valid[:, None], scale)
        kc = load_normed(k_ptr, t[:, None] * k_t + kh * k_h, krow[None, :], dk, valid[:, None], 1.0)
        vc = tl.load(
            v_ptr + t[:, None] * v_t + h * v_h + vcol[None, :],
            mask=valid[:, None] & vmask[None, :],
            other=0.0,
        ).to(tl.float32)
        gc = tl.load(g_ptr + t * g_t + h * g_h, mask=valid, other=0.0).to(tl.float32)
        bc = tl.load(beta_ptr + t * b_t + h, mask=valid, other=0.0).to(tl.float32)
        cum = tl.cumsum(gc, axis=0)  # log decay from the chunk start through row i
        cum_end = tl.sum(gc, axis=0)
        decay = tl.where(lower_incl, tl.exp(cum[:, None] - cum[None, :]), 0.0)
        kk = tl.dot(kc, tl.trans(kc), input_precision=PRECISION)
        inv = unit_lower_inverse(tl.where(r[:, None] > r[None, :], kk * decay * bc[:, None], 0.0), C)
        v_solved = tl.dot(inv, vc * bc[:, None], input_precision=PRECISION)
        k_solved = tl.dot(inv, kc * (bc * tl.exp(cum))[:, None], input_precision=PRECISION)
        new_v = v_solved - tl.dot(k_solved, state, input_precision=PRECISION)
        intra = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * decay
        out = tl.dot(qc * tl.exp(cum)[:, None], state, input_precision=PRECISION)
        out += tl.dot(intra, new_v, input_precision=PRECISION)
        tl.store(
            out_ptr + t[:, None] * o_t + h * o_h + vcol[None, :], out, mask=valid[:, None] & vmask[None, :]
        )
        k_to_end = kc * tl.exp(cum_end - cum)[:, None]
        state = state * tl.exp(cum_end) + tl.dot(tl.trans(k_to_end), new_v, input_precision=PRECISION)
    tl.store(s_ptrs, state, mask=smask)


def _launch(kernel, grid, q, k, v, g, beta, state_pool, state_slots, fresh, out, extra, **meta) -> None:
    hv, hk = v.shape[1], k.shape[1]
    dk, dv = k.shape[2], v.shape[2]
    kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state_pool,
        state_slots,
        fresh if fresh.dtype == torch.int8 else fresh.to(torch.int8),
        *extra,
        out,
        hv // hk,
        dk,
        dv,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        state_pool.stride(0),
        state_pool.stride(1),
        out.stride(0),
        out.stride(1),
        dk**-0.5,
        g.stride(1),
        **meta,
    )


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor) -> None:
    if state_pool.dtype != torch.float32 or not state_pool[0].is_contiguous():
        raise ValueError("gated delta kernels need a contiguous fp32 state pool [slots, Hv, dk, dv]")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("gated delta kernels need q, k, v with a contiguous last dim")


def gdn_decode_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence (row ``b`` is sequence ``b``); no host sync, so graph-capturable. ``g`` per head
    or per head and key channel."""
    _check(q, k, v, state_pool)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    dk, dv = k.shape[2], v.shape[2]
    bv = min(32, next_pow2(dv))
    if v.shape[0]:
        _launch(
            _gdn_decode_kernel,
            (v.shape[0], v.shape[1], triton.cdiv(dv, bv)),
            q,
            k,
            v,
            g,
            beta,
            state_pool,
            state_slots,
            fresh,
            out,
            (),
            BK=next_pow2(dk),
            BV=bv,
            PER_CHANNEL=g.dim() == 3,
            num_warps=4,
        )
    return out


def gdn_chunked_prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    fresh: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Varlen sequences (``query_start_loc [B+1]``), chunked; any lengths, decode rows included. ``g`` per head."""
    _check(q, k, v, state_pool)
    if g.dim() != 2:
        raise ValueError(
            "the chunked gated delta kernel takes one decay per head ([T, Hv]), not per key channel"
        )
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    dk, dv = k.shape[2], v.shape[2]
    bv = min(64, next_pow2(dv))
    batch = state_slots.shape[0]
    if batch and v.shape[0]:
        _launch(
            _gdn_chunk_kernel,
            (batch, v.shape[1], triton.cdiv(dv, bv)),
            q,
            k,
            v,
            g,
            beta,
            state_pool,
            state_slots,
            fresh,
            out,
            (query_start_loc,),
            C=chunk_size,
            BK=max(16, next_pow2(dk)),
            BV=bv,
            PRECISION="ieee",
            num_warps=8 if chunk_size >= 64 else 4,
        )
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    fresh: torch.Tensor,
    decode_only: bool,
) -> torch.Tensor:
    """Dispatch: the decode kernel for one-token rows, the chunked kernel otherwise, torch off CUDA."""
    if not use_triton(v):
        return gated_delta_ref(q, k, v, g, beta, state_pool, state_slots, query_start_loc, fresh)
    if decode_only:
        return gdn_decode_step_triton(q, k, v, g, beta, state_pool, state_slots, fresh)
    return gdn_chunked_prefill_triton(q, k, v, g, beta, state_pool, state_slots, query_start_loc, fresh)
