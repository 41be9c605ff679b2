"""The window ring's update after a step's attention: each sequence's rows at its last ``R`` positions go to its ring.

A sliding-window layer keeps the ``R`` positions before the current step of every request in a ring
``[slots, R, Hk, D]`` (position ``j`` at index ``j % R``, ``dgpp.kernels.window_attention`` reads it). After the
step's attention read the ring, each sequence's rows at positions ``>= seq_len - R`` are stored there; earlier rows
of a long chunk are never needed again. Rows are cast to the ring's dtype (e4m3 codes and their ``[.., 1]`` scales
are written by two calls). A padding row (``seq_lens == 0`` or state slot -1) writes nothing.

The Triton kernel gives one program to each (row, KV head); the rows it keeps land on distinct indices, so the
programs never race.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.window_attention import row_sequences


class RingWriteInputs(NamedTuple):
    """One ring update: this step's rows ``k [T, Hk, D]`` / ``v [T, Hk, Dv]``, the rings ``[slots, R, Hk, .]``
    they go to, each sequence's state slot, the step's ``query_start_loc [B+1]`` / ``context_lens [B]`` /
    ``seq_lens [B]``, and ``row_seq``: the step's ``row_sequences`` when the caller keeps them for every layer
    (computed here otherwise)."""

    k: torch.Tensor
    v: torch.Tensor
    k_ring: torch.Tensor
    v_ring: torch.Tensor
    state_slots: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    row_seq: torch.Tensor | None = None


def ring_write_ref(step: RingWriteInputs) -> None:
    """Store each sequence's rows at positions ``>= seq_len - R`` into its ring (index ``position % R``)."""
    k, v, k_ring, v_ring, state_slots, query_start_loc, context_lens, seq_lens, _ = step
    cap = k_ring.shape[1]
    starts = query_start_loc.tolist()
    for b, (ctx, n, slot) in enumerate(
        zip(context_lens.tolist(), seq_lens.tolist(), state_slots.tolist(), strict=True)
    ):
        if slot < 0 or n == 0:
            continue
        first = max(ctx, n - cap)
        rows = torch.arange(starts[b] + first - ctx, starts[b + 1], device=k.device)
        idx = torch.arange(first, n, device=k.device) % cap
        k_ring[slot, idx] = k[rows].to(k_ring.dtype)
        v_ring[slot, idx] = v[rows].to(v_ring.dtype)


@triton.jit
def _ring_write_kernel(
    k_ptr,
    v_ptr,
    kr_ptr,
    vr_ptr,
    slots_ptr,
    row_seq_ptr,
    qsl_ptr,
    ctx_ptr,
    lens_ptr,
    head_dim,
    v_dim,
    cap,
    k_t,
    k_h,
    v_t,
    v_h,
    kr_0,
    kr_1,
    kr_2,
    vr_0,
    vr_1,
    vr_2,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = tl.load(row_seq_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b).to(tl.int64)
    pos = tl.load(ctx_ptr + b).to(tl.int64) + r - tl.load(qsl_ptr + b).to(tl.int64)
    keep = (
        (slot >= 0) & (seq_len > 0) & (pos >= seq_len - cap)
    )  # the last R positions: no two rows share an index
    idx = pos % cap
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    kk = tl.load(k_ptr + r * k_t + h * k_h + d, mask=d < head_dim)
    tl.store(
        kr_ptr + slot * kr_0 + idx * kr_1 + h * kr_2 + d,
        kk.to(kr_ptr.dtype.element_ty),
        mask=keep & (d < head_dim),
    )
    vv = tl.load(v_ptr + r * v_t + h * v_h + dv, mask=dv < v_dim)
    tl.store(
        vr_ptr + slot * vr_0 + idx * vr_1 + h * vr_2 + dv,
        vv.to(vr_ptr.dtype.element_ty),
        mask=keep & (dv < v_dim),
    )


def ring_write_triton(step: RingWriteInputs) -> None:
    k, v, k_ring, v_ring, state_slots, query_start_loc, context_lens, seq_lens, row_seq = step
    rows, hk, head_dim = k.shape
    if rows == 0:
        return
    row_seq = row_sequences(query_start_loc, rows) if row_seq is None else row_seq
    _ring_write_kernel[(rows, hk)](
        k,
        v,
        k_ring,
        v_ring,
        state_slots,
        row_seq,
        query_start_loc,
        context_lens,
        seq_lens,
        head_dim,
        v.shape[-1],
        k_ring.shape[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_ring.stride(0),
        k_ring.stride(1),
        k_ring.stride(2),
        v_ring.stride(0),
        v_ring.stride(1),
        v_ring.stride(2),
        BLOCK_D=next_pow2(head_dim),
        BLOCK_DV=next_pow2(v.shape[-1]),
        num_warps=1,
    )


def ring_write(step: RingWriteInputs) -> None:
    """Ring update after the step's attention; Triton on CUDA, the torch reference elsewhere."""
    if use_triton(step.k):
        ring_write_triton(step)
    else:
        ring_write_ref(step)
