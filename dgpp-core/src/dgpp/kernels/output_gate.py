"""The attention's sigmoid output gate, one pass: ``out = attn · sigmoid(gate)``.

``attn [T, H*D]`` (the attention's flat heads), ``gate [T, H, D]`` (any strides: the gate half of Qwen3.5's
``[q|gate]`` projection is read in place, with no copy) -> ``[T, H*D]`` in attn's dtype. Rounding points of the
torch chain ``attn * torch.sigmoid(gate)``: the sigmoid is rounded to the gate's dtype, the product to attn's.
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
