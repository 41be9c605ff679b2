"""Sigmoid gates in one pass each: the attention's output gate ``attn · sigmoid(gate)`` and the shared expert's
gated add ``routed + sigmoid(gate) · shared``.

Output gate: ``attn [T, H*D]`` (the attention's flat heads), ``gate [T, H, D]`` (any strides: the gate half of
Qwen3.5's ``[q|gate]`` projection is read in place, with no copy) -> ``[T, H*D]`` in attn's dtype. Shared expert:
``routed, shared [T, H]``, ``gate [T, 1]`` (one logit per token) -> ``[T, H]``. Both keep the rounding points of
the torch chain: the sigmoid rounded to the gate's dtype, each product and sum to the output's.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton


def sigmoid_gate_ref(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return attn * torch.sigmoid(gate).reshape(attn.shape)


@triton.jit
def _sigmoid_gate_kernel(
    attn_ptr, gate_ptr, out_ptr, head_dim, a_tok, g_tok, g_head, o_tok, BLOCK: tl.constexpr
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < head_dim
    g = tl.load(gate_ptr + tok * g_tok + head * g_head + d, mask=mask, other=0.0)
    sig = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(g.dtype).to(tl.float32)
    a = tl.load(attn_ptr + tok * a_tok + head * head_dim + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * o_tok + head * head_dim + d, (a * sig).to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate_triton(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    tokens, heads, head_dim = gate.shape
    if attn.shape != (tokens, heads * head_dim) or attn.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("sigmoid_gate needs attn [T, H*D] and gate [T, H, D] with contiguous last dims")
    out = torch.empty_like(attn, memory_format=torch.contiguous_format)
    if tokens:
        _sigmoid_gate_kernel[(tokens, heads)](
            attn,
            gate,
            out,
            head_dim,
            attn.stride(0),
            gate.stride(0),
            gate.stride(1),
            out.stride(0),
            BLOCK=next_pow2(head_dim),
            num_warps=1,
        )
    return out


def sigmoid_gate(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``attn · sigmoid(gate)``; one Triton launch on CUDA, torch elsewhere."""
    fn = sigmoid_gate_triton if use_triton(attn) else sigmoid_gate_ref
    return fn(attn, gate)


def shared_expert_add_ref(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return routed + torch.sigmoid(gate) * shared


@triton.jit
def _shared_expert_add_kernel(
    routed_ptr, shared_ptr, gate_ptr, out_ptr, hidden, r_tok, s_tok, g_tok, o_tok, BLOCK: tl.constexpr
):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    g = tl.load(gate_ptr + tok * g_tok)
    sig = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(g.dtype).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    shared = tl.load(shared_ptr + tok * s_tok + cols, mask=mask, other=0.0).to(tl.float32)
    gated = (sig * shared).to(out_ty).to(tl.float32)
    routed = tl.load(routed_ptr + tok * r_tok + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * o_tok + cols, (routed + gated).to(out_ty), mask=mask)


def shared_expert_add_triton(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    tokens, hidden = routed.shape
    if (
        shared.shape != routed.shape
        or gate.shape != (tokens, 1)
        or routed.stride(-1) != 1
        or shared.stride(-1) != 1
    ):
        raise ValueError(
            "shared_expert_add needs routed and shared [T, H] with contiguous rows and gate [T, 1]"
        )
    out = torch.empty(tokens, hidden, dtype=routed.dtype, device=routed.device)
    block = min(1024, next_pow2(hidden))
    if tokens:
        _shared_expert_add_kernel[(tokens, triton.cdiv(hidden, block))](
            routed,
            shared,
            gate,
            out,
            hidden,
            routed.stride(0),
            shared.stride(0),
            gate.stride(0),
            out.stride(0),
            BLOCK=block,
        )
    return out


def shared_expert_add(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``routed + sigmoid(gate) · shared``; one Triton launch on CUDA, torch elsewhere."""
    fn = shared_expert_add_triton if use_triton(routed) else shared_expert_add_ref
    return fn(routed, shared, gate)
