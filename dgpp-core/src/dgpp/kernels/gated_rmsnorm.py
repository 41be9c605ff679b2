"""The gated delta rule's output norm in one pass: per-head RMSNorm, times the weight, times an activated gate.

``x [T, H, D]`` (the delta rule's fp32 output, or already in ``out_dtype``), ``gate [T, H, D]``, ``weight [D]``
-> ``[T, H, D]`` in ``out_dtype``. The rounding points are the layer's torch order: ``x`` is cast to ``out_dtype``,
the norm is taken in fp32 and its row rounded to ``out_dtype``, ``weight · x̂`` is rounded to ``out_dtype``, then
multiplied by ``act(gate)`` in fp32 (SiLU, or sigmoid) and rounded once. One program per (token, head) row replaces
the cast, norm, casts, activation and products the torch chain launches one by one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton


class GatedRmsNormInputs(NamedTuple):
    """One norm call's inputs, as the module docstring names them (``sigmoid``: gate with sigmoid, not SiLU)."""

    x: torch.Tensor
    gate: torch.Tensor
    weight: torch.Tensor
    eps: float
    out_dtype: torch.dtype
    sigmoid: bool = False


def gated_rms_norm_ref(step: GatedRmsNormInputs) -> torch.Tensor:
    x, gate, weight, eps, out_dtype, sigmoid = step
    x = x.to(out_dtype)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(out_dtype)
    act = torch.sigmoid(gate.float()) if sigmoid else F.silu(gate.float())
    return (weight * normed * act).to(out_dtype)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    n_cols,
    x_tok,
    x_head,
    g_tok,
    g_head,
    o_tok,
    o_head,
    eps,
    SIGMOID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    out_ty = out_ptr.dtype.element_ty
    # the layer casts the delta rule's output to the activation dtype before its norm
    x = tl.load(x_ptr + tok * x_tok + head * x_head + cols, mask=mask, other=0.0).to(out_ty).to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(out_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scaled = (w * normed).to(out_ty).to(tl.float32)
    g = tl.load(gate_ptr + tok * g_tok + head * g_head + cols, mask=mask, other=0.0).to(tl.float32)
    act = 1.0 / (1.0 + tl.exp(-g))
    if not SIGMOID:
        act = g * act
    tl.store(out_ptr + tok * o_tok + head * o_head + cols, (scaled * act).to(out_ty), mask=mask)


def gated_rms_norm_triton(step: GatedRmsNormInputs) -> torch.Tensor:
    x, gate, weight, eps, out_dtype, sigmoid = step
    if x.dim() != 3 or gate.shape != x.shape or x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("gated_rms_norm needs x and gate [T, H, D] of one shape with a contiguous last dim")
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=out_dtype, device=x.device)
    if tokens:
        _gated_rms_norm_kernel[(tokens, heads)](
            x,
            gate,
            weight,
            out,
            dim,
            x.stride(0),
            x.stride(1),
            gate.stride(0),
            gate.stride(1),
            out.stride(0),
            out.stride(1),
            float(eps),
            SIGMOID=sigmoid,
            BLOCK=next_pow2(dim),
            num_warps=1,
        )
    return out


def gated_rms_norm(step: GatedRmsNormInputs) -> torch.Tensor:
    """``(weight · rmsnorm(x)) · act(gate)`` in ``out_dtype``; one Triton launch on CUDA, torch elsewhere."""
    fn = gated_rms_norm_triton if use_triton(step.x) else gated_rms_norm_ref
    return fn(step)
