"""The chunked gated delta rule's sequential part: the state handed from chunk to chunk, in one launch.

The chunked form (``dgpp.nn.gated_delta_rule.chunked_gated_delta_rule``) solves every chunk's UT transform at once
for all chunks; what is left is, per chunk ``n`` of a (sequence, value head)::

    new = values_solved[n] - keys_solved[n] @ S
    out[n] = q_decayed[n] @ S + intra[n] @ new
    S = S * chunk_decay[n] + k_to_end[n]^T @ new

Written as torch products that is four small matrix products and five elementwise launches per chunk, chunk
after chunk (an 8,192-token prompt: 128 chunks, some 1,200 launches a layer). Here one program per (sequence and
head, ``BLOCK_V`` columns of the state) walks every chunk with its ``[dk, BLOCK_V]`` state tile, which it keeps in
the output state's buffer and takes ``PIECE`` key rows at a time.
The products take ``PRECISION`` (``ieee``: fp32 on the CUDA cores, the torch form's precision); their sums run
in another order than cuBLAS's, so the outputs agree with the torch form to fp32 rounding, not bit for bit, as
the chunked form agrees with the token-by-token recurrence.

Inputs are fp32 and contiguous, chunk-major per (sequence, head): ``values_solved [BH, N, C, dv]``,
``keys_solved``, ``q_decayed``, ``k_to_end [BH, N, C, dk]``, ``intra [BH, N, C, C]``, ``chunk_decay [BH, N]``,
``state [BH, dk, dv]``. Returns ``(out [BH, N, C, dv], final state [BH, dk, dv])``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton

# state columns a program walks, key rows a product takes at once, warps: the sm_90 build of (32, 32, 8) holds
# its tiles in 227 registers a thread without spilling (wider column tiles, or 4 warps, spill)
BLOCK_V = 32
PIECE = 32
_WARPS = 8


class ChunkWalkInputs(NamedTuple):
    """One walk's operands (shapes in the module docstring)."""

    values_solved: torch.Tensor
    keys_solved: torch.Tensor
    q_decayed: torch.Tensor
    intra: torch.Tensor
    k_to_end: torch.Tensor
    chunk_decay: torch.Tensor
    state: torch.Tensor


def chunk_walk_ref(step: ChunkWalkInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch products, chunk after chunk."""
    values_solved, keys_solved, q_decayed, intra, k_to_end, chunk_decay, state = step
    out = torch.empty_like(values_solved)
    for n in range(values_solved.shape[1]):
        new = values_solved[:, n] - keys_solved[:, n] @ state
        out[:, n] = q_decayed[:, n] @ state + intra[:, n] @ new
        state = state * chunk_decay[:, n, None, None] + k_to_end[:, n].transpose(-1, -2) @ new
    return out, state


@triton.jit
def _chunk_walk_kernel(
    vs_ptr,
    ks_ptr,
    qd_ptr,
    intra_ptr,
    kte_ptr,
    decay_ptr,
    state_ptr,
    out_ptr,
    final_ptr,
    num_chunks,
    dk,
    dv,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PIECE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The state tile lives in ``final`` (this program's columns only) and is read and written in ``PIECE`` key
    rows at a time: a product over all ``dk`` at once would hold every operand row of it in registers."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, CHUNK)
    vs_cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = vs_cols < dv
    for p in tl.static_range(BLOCK_K // PIECE):  # the working copy of the incoming state
        kp = p * PIECE + tl.arange(0, PIECE)
        offs = bh * dk * dv + kp[:, None] * dv + vs_cols[None, :]
        mask = (kp < dk)[:, None] & v_mask[None, :]
        tl.store(final_ptr + offs, tl.load(state_ptr + offs, mask=mask, other=0.0), mask=mask)
    tl.debug_barrier()
    for n in range(num_chunks):
        chunk = bh * num_chunks + n
        v_offs = chunk * CHUNK * dv + rows[:, None] * dv + vs_cols[None, :]
        predicted = tl.zeros([CHUNK, BLOCK_V], tl.float32)  # keys_solved @ S
        read = tl.zeros([CHUNK, BLOCK_V], tl.float32)  # q_decayed @ S
        for p in tl.static_range(BLOCK_K // PIECE):
            kp = p * PIECE + tl.arange(0, PIECE)
            k_mask = kp < dk
            k_offs = chunk * CHUNK * dk + rows[:, None] * dk + kp[None, :]
            s_offs = bh * dk * dv + kp[:, None] * dv + vs_cols[None, :]
            state = tl.load(final_ptr + s_offs, mask=k_mask[:, None] & v_mask[None, :], other=0.0)
            keys = tl.load(ks_ptr + k_offs, mask=k_mask[None, :], other=0.0)
            predicted = tl.dot(keys, state, predicted, input_precision=PRECISION)
            queries = tl.load(qd_ptr + k_offs, mask=k_mask[None, :], other=0.0)
            read = tl.dot(queries, state, read, input_precision=PRECISION)
        new = tl.load(vs_ptr + v_offs, mask=v_mask[None, :], other=0.0) - predicted
        intra = tl.load(intra_ptr + chunk * CHUNK * CHUNK + rows[:, None] * CHUNK + rows[None, :])
        out = tl.dot(intra, new, read, input_precision=PRECISION)
        tl.store(out_ptr + v_offs, out, mask=v_mask[None, :])
        tl.debug_barrier()  # every piece read before any is rewritten
        decay = tl.load(decay_ptr + chunk)
        for p in tl.static_range(BLOCK_K // PIECE):
            kp = p * PIECE + tl.arange(0, PIECE)
            k_mask = kp < dk
            s_offs = bh * dk * dv + kp[:, None] * dv + vs_cols[None, :]
            s_mask = k_mask[:, None] & v_mask[None, :]
            state = tl.load(final_ptr + s_offs, mask=s_mask, other=0.0)
            to_end = tl.load(
                kte_ptr + chunk * CHUNK * dk + rows[:, None] * dk + kp[None, :],
                mask=k_mask[None, :],
                other=0.0,
            )
            state = state * decay + tl.dot(tl.trans(to_end), new, input_precision=PRECISION)
            tl.store(final_ptr + s_offs, state, mask=s_mask)
        tl.debug_barrier()  # the next chunk reads the whole updated tile


def chunk_walk_triton(step: ChunkWalkInputs) -> tuple[torch.Tensor, torch.Tensor]:
    values_solved, keys_solved, q_decayed, intra, k_to_end, chunk_decay, state = step
    heads, num_chunks, chunk, dv = values_solved.shape
    dk = keys_solved.shape[-1]
    if (
        any(t.dtype != torch.float32 or not t.is_contiguous() for t in step)
        or keys_solved.shape != (heads, num_chunks, chunk, dk)
        or q_decayed.shape != keys_solved.shape
        or k_to_end.shape != keys_solved.shape
        or intra.shape != (heads, num_chunks, chunk, chunk)
        or chunk_decay.shape != (heads, num_chunks)
        or state.shape != (heads, dk, dv)
        or chunk < 16
        or chunk & (chunk - 1)
    ):
        raise ValueError("chunk_walk takes contiguous fp32 [BH, N, C, d] chunks (C a power of two >= 16)")
    out = torch.empty_like(values_solved)
    final = torch.empty_like(state)
    block_v = min(BLOCK_V, max(16, next_pow2(dv)))
    if heads:
        _chunk_walk_kernel[(heads, triton.cdiv(dv, block_v))](
            *step,
            out,
            final,
            num_chunks,
            dk,
            dv,
            CHUNK=chunk,
            BLOCK_K=max(PIECE, next_pow2(dk)),
            BLOCK_V=block_v,
            PIECE=PIECE,
            PRECISION="ieee",
            num_warps=_WARPS,
        )
    return out, final


def chunk_walk(step: ChunkWalkInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, final state)`` of the chunk-to-chunk hand-off: one Triton launch on CUDA, torch elsewhere."""
    fn = chunk_walk_triton if use_triton(step.state) else chunk_walk_ref
    return fn(step)
