"""The chunked gated delta rule's parallel part: every chunk's UT transform and decays, one program per (sequence
and head, chunk), all chunks at once.

Per chunk of ``C`` rows of one (sequence, value head), with ``G`` the running sum of the log decay ``g`` from the
chunk's first row and ``A_ij = beta_i k_i.k_j exp(G_i - G_j)`` for ``j < i``::

    T = (I + A)^-1                                   forward substitution, row after row
    values_solved = T (beta v)                       keys_solved = T (beta exp(G) k)
    intra_ij = q_i.k_j exp(G_i - G_j), j <= i        q_decayed = exp(G) q
    k_to_end = exp(G_last - G) k                     chunk_decay = exp(G_last)

which ``delta_chunk_walk`` then hands on from chunk to chunk. q and k arrive as the layer made them (``[B, L, Hk, dk]``,
any float dtype, any row strides) and are L2-normalised here, q also scaled by ``dk^-1/2``; value head ``j`` reads
key head ``j // (Hv / Hk)``. Rows past ``L`` read as k = v = beta = g = 0, as the padded torch form's do, so they
leave the state as it was. v is ``[B, L, Hv, dv]``, g and beta ``[B, L, Hv]`` (one decay per head; a decay per key
channel stays on the torch form). The products run in fp32 on the CUDA cores (``ieee``); their sums run in another
order than the torch form's batched products and triangular solve, so the two agree to fp32 rounding, not bit for
bit. Outputs are the walk's operands, fp32 and contiguous (``ChunkWalkInputs``).
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton
from dgpp.kernels.delta_chunk_walk import ChunkWalkInputs
from dgpp.kernels.gated_delta import l2_factor, unit_lower_inverse

# key columns (and inverse columns) a product takes at once, warps
PIECE = 16
_WARPS = 8


@triton.jit
def _row_scale(ptr, row_off, cols, dk, valid, scale):
    """``[C, 1]``: each row's ``l2_factor`` (``load_normed``'s), from one load of the whole rows."""
    x = tl.load(ptr + row_off + cols[None, :], mask=valid[:, None] & (cols < dk)[None, :], other=0.0)
    return l2_factor(x.to(tl.float32), scale)


@triton.jit
def _chunk_prep_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    vs_ptr,
    ks_ptr,
    qd_ptr,
    intra_ptr,
    kte_ptr,
    decay_ptr,
    inverse_ptr,
    length,
    num_chunks,
    heads,
    group,
    dk,
    dv,
    q_b,
    q_t,
    q_h,
    k_b,
    k_t,
    k_h,
    v_b,
    v_t,
    v_h,
    g_b,
    g_t,
    g_h,
    beta_b,
    beta_t,
    beta_h,
    scale,
    C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PIECE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program ``(sequence * heads + head) * num_chunks + n`` writes chunk ``n``'s operands. Products over fp32
    on the CUDA cores hold each operand row whole in registers, so every product takes ``PIECE`` columns of its
    K side at a time: the key and query columns from memory, the inverse's columns through ``inverse_ptr``
    (this chunk's ``[C, C]`` scratch), and ``keys_solved``'s right-hand side through its own output rows, which
    are overwritten with the result once every piece is read."""
    chunk = tl.program_id(0).to(tl.int64)
    bh = chunk // num_chunks
    b = bh // heads
    h = bh % heads
    kh = h // group
    r = tl.arange(0, C)
    t = (chunk % num_chunks) * C + r
    valid = t < length
    kcol = tl.arange(0, BLOCK_K)
    vcol = tl.arange(0, BLOCK_V)
    k_rows = b * k_b + t[:, None] * k_t + kh * k_h
    k_out = chunk * C * dk + r[:, None] * dk + kcol[None, :]
    q_rows = b * q_b + t[:, None] * q_t + kh * q_h

    gc = tl.load(g_ptr + b * g_b + t * g_t + h * g_h, mask=valid, other=0.0).to(tl.float32)
    bc = tl.load(beta_ptr + b * beta_b + t * beta_t + h * beta_h, mask=valid, other=0.0).to(tl.float32)
    cum = tl.cumsum(gc, axis=0)  # log decay from the chunk's first row through row i
    cum_end = tl.sum(tl.where(r == C - 1, cum, 0.0), axis=0)
    tl.store(decay_ptr + chunk, tl.exp(cum_end))
    decay = tl.where(r[:, None] >= r[None, :], tl.exp(cum[:, None] - cum[None, :]), 0.0)
    k_scale = _row_scale(k_ptr, k_rows, kcol, dk, valid, 1.0)
    q_scale = _row_scale(q_ptr, q_rows, kcol, dk, valid, scale)

    intra = tl.zeros([C, C], tl.float32)
    a = tl.zeros([C, C], tl.float32)
    for p in tl.static_range(BLOCK_K // PIECE):
        cols = p * PIECE + tl.arange(0, PIECE)
        on = valid[:, None] & (cols < dk)[None, :]
        kp = tl.load(k_ptr + k_rows + cols[None, :], mask=on, other=0.0).to(tl.float32) * k_scale
        qp = tl.load(q_ptr + q_rows + cols[None, :], mask=on, other=0.0).to(tl.float32) * q_scale
        out = chunk * C * dk + r[:, None] * dk + cols[None, :]
        keep = (cols < dk)[None, :]
        tl.store(kte_ptr + out, kp * tl.exp(cum_end - cum)[:, None], mask=keep)
        tl.store(qd_ptr + out, qp * tl.exp(cum)[:, None], mask=keep)
        tl.store(ks_ptr + out, kp * tl.exp(cum)[:, None], mask=keep)  # keys_solved's right-hand side, for now
        intra = tl.dot(qp, tl.trans(kp), intra, input_precision=PRECISION)
        a = tl.dot(kp * bc[:, None], tl.trans(kp), a, input_precision=PRECISION)
    tl.store(intra_ptr + chunk * C * C + r[:, None] * C + r[None, :], intra * decay)
    inverse = unit_lower_inverse(tl.where(r[:, None] > r[None, :], a * decay, 0.0), C)
    # beta scales the right-hand sides' rows, so it scales the inverse's columns
    tl.store(inverse_ptr + chunk * C * C + r[:, None] * C + r[None, :], inverse * bc[None, :])
    tl.debug_barrier()

    keys_solved = tl.zeros([C, BLOCK_K], tl.float32)
    for p in tl.static_range(C // PIECE):
        j = p * PIECE + tl.arange(0, PIECE)
        inv = tl.load(inverse_ptr + chunk * C * C + r[:, None] * C + j[None, :])
        ks_rhs = tl.load(
            ks_ptr + chunk * C * dk + j[:, None] * dk + kcol[None, :], mask=(kcol < dk)[None, :], other=0.0
        )
        keys_solved = tl.dot(inv, ks_rhs, keys_solved, input_precision=PRECISION)
    tl.debug_barrier()  # every piece of the right-hand side read before it is overwritten
    tl.store(ks_ptr + k_out, keys_solved, mask=(kcol < dk)[None, :])

    values_solved = tl.zeros([C, BLOCK_V], tl.float32)
    for p in tl.static_range(C // PIECE):
        j = p * PIECE + tl.arange(0, PIECE)
        inv = tl.load(inverse_ptr + chunk * C * C + r[:, None] * C + j[None, :])
        vt = (chunk % num_chunks) * C + j
        v_rhs = tl.load(
            v_ptr + b * v_b + vt[:, None] * v_t + h * v_h + vcol[None, :],
            mask=(vt < length)[:, None] & (vcol < dv)[None, :],
            other=0.0,
        ).to(tl.float32)
        values_solved = tl.dot(inv, v_rhs, values_solved, input_precision=PRECISION)
    tl.store(
        vs_ptr + chunk * C * dv + r[:, None] * dv + vcol[None, :], values_solved, mask=(vcol < dv)[None, :]
    )


def chunk_prep_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> ChunkWalkInputs:
    """The walk's operands for the padded batch (shapes in the module docstring; ``state [B, Hv, dk, dv]``, taken
    into the operands as fp32 ``[B*Hv, dk, dv]``)."""
    batch, length, heads, dv = v.shape
    dk = k.shape[-1]
    if (
        g.shape != (batch, length, heads)
        or beta.shape != g.shape
        or q.shape != k.shape
        or k.shape[:2] != (batch, length)
        or heads % k.shape[2]
        or any(x.stride(-1) != 1 for x in (q, k, v))
        or chunk_size < 16
        or chunk_size & (chunk_size - 1)
    ):
        raise ValueError(
            "chunk_prep takes q/k [B, L, Hk, dk], v [B, L, Hv, dv] (last dims contiguous), g and beta [B, L, Hv], "
            "and a chunk size that is a power of two >= 16"
        )
    num_chunks = triton.cdiv(length, chunk_size)
    rows = batch * heads * num_chunks

    def chunked(width: int) -> torch.Tensor:
        return torch.empty(batch * heads, num_chunks, chunk_size, width, dtype=torch.float32, device=v.device)

    step = ChunkWalkInputs(
        chunked(dv),
        chunked(dk),
        chunked(dk),
        chunked(chunk_size),
        chunked(dk),
        torch.empty(batch * heads, num_chunks, dtype=torch.float32, device=v.device),
        state.float().reshape(batch * heads, dk, dv).contiguous(),
    )
    if rows:
        _chunk_prep_kernel[(rows,)](
            q,
            k,
            v,
            g,
            beta,
            *step[:6],
            torch.empty(rows, chunk_size, chunk_size, dtype=torch.float32, device=v.device),
            length,
            num_chunks,
            heads,
            heads // k.shape[2],
            dk,
            dv,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *g.stride(),
            *beta.stride(),
            dk**-0.5,
            C=chunk_size,
            BLOCK_K=max(16, next_pow2(dk)),
            BLOCK_V=max(16, next_pow2(dv)),
            PIECE=min(PIECE, chunk_size),
            PRECISION="ieee",
            num_warps=_WARPS,
        )
    return step
