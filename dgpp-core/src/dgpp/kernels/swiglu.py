"""SwiGLU activation: ``silu(gate) * up`` for ``x = [gate | up]`` along the last dim (``[..., 2I] -> [..., I]``).

The fused gate/up projection writes both halves in one GEMM; this reads them once and writes the
product once, instead of three eager passes (silu, multiply, and the temporaries between).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels._triton import tl, triton, use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    inter,
    gate_stride,
    up_stride,
    out_stride,
    limit,
    BLOCK: tl.constexpr,
    CLAMP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:  # torch's clamp of the inputs: compared in fp32, rounded back to their dtype (NaN kept)
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(up, limit, propagate_nan=tl.PropagateNan.ALL)
        gate = gate.to(gate_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(up_ptr.dtype.element_ty).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_pair_triton(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for two ``[..., I]`` tensors (separate gate and up projections); ``limit``: the inputs
    clamped first (``gate <= limit``, ``-limit <= up <= limit``), as ``torch.clamp`` would, in the same pass."""
    shape = gate.shape
    g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    inter = shape[-1]
    out = torch.empty(g2.shape[0], inter, dtype=gate.dtype, device=gate.device)
    block = 1024
    if g2.shape[0]:
        _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(inter, block))](
            g2,
            u2,
            out,
            inter,
            g2.stride(0),
            u2.stride(0),
            out.stride(0),
            0.0 if limit is None else float(limit),
            BLOCK=block,
            CLAMP=limit is not None,
            num_warps=4,
        )
    return out.view(shape)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return silu_mul_pair_triton(x[..., :inter], x[..., inter:])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]``; Triton on CUDA, torch elsewhere."""
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_ref(x)


def silu_mul_pair(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up`` after clamping at ``limit`` (``None``: no clamp); Triton on CUDA, torch elsewhere."""
    if use_triton(gate):
        return silu_mul_pair_triton(gate, up, limit)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
