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
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    inter = shape[-1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out.view(*shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]``; Triton on CUDA, torch elsewhere."""
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_ref(x)
