"""RMSNorm, plain (``w · x̂``) and zero-centred (``(1 + w) · x̂``, Qwen3.5 / Qwen3-Next), and the residual
add fused into it (``add_rms_norm``), one op for every device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.nn.weights import default_weight_loader, set_weight_attrs

_FP32_NORMED = (torch.float32, torch.bfloat16, torch.float16)  # dtypes torch's rms_norm computes in fp32


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, computed in fp32 (returned in fp32): ``xf * rsqrt(mean(xf²) + eps)``,
    which is what torch's ``rms_norm`` computes for an fp32 input, op for op (one call in place of five: a
    CPU decode step runs 61 norms)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim.

    ``zero_centered=False``: ``w * x̂.to(dtype)`` (the product in the activation dtype, as Llama/Qwen3).
    ``zero_centered=True``: ``(x̂ * (1 + w)).to(dtype)`` (the product in fp32; weights stored around 0).
    A subclass with ``fp32_product = True``: ``(w · x̂).to(dtype)`` (plain weights, the product in fp32, as
    gpt-oss). The orders differ in bf16, so each family picks the one its reference uses.
    """

    fp32_product = False

    def __init__(
        self, dim: int, eps: float = 1e-6, *, zero_centered: bool = False, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one Triton pass, same rounding order
            from dgpp import kernels

            return kernels.rms_norm(x, self.weight, self.eps, None, *self.kernel_numerics())
        if not (self.zero_centered or self.fp32_product) and x.dtype in _FP32_NORMED:
            # x̂ rounded to x's dtype, then the product: torch's rms_norm of a bf16/fp16 input is the fp32 one
            # of its upcast, rounded back (the same ops in one call: 61 norms a CPU decode step)
            return self.weight * torch.rms_norm(x, (x.shape[-1],), eps=self.eps)
        normed = rms_normalize(x, self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if self.fp32_product:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(
            x.dtype
        )  # other dtypes (float64): x̂ rounded to x's dtype, then the product

    def kernel_numerics(self) -> tuple[float, bool]:
        """``(weight_offset, fp32_product)`` of ``dgpp.kernels.rmsnorm`` for this norm's order."""
        return (1.0 if self.zero_centered else 0.0), self.zero_centered or self.fp32_product

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)``: the residual stream's add and the norm that follows it.

    Where kernels run Triton this is one pass (``dgpp.kernels.rms_norm`` with a residual), which rounds the sum
    to the activation dtype exactly as the eager add does; elsewhere the add, then ``norm``. A model writes its
    residual stream with this op once, so every device runs the same sequence of layers and reductions. A
    norm other than ``RMSNorm`` runs after the add.
    """
    from dgpp.kernels import rmsnorm  # imported on use: the layers import no kernel module up front

    if isinstance(norm, RMSNorm) and rmsnorm.use_triton(x):
        return rmsnorm.rms_norm_triton(x, norm.weight, norm.eps, residual, *norm.kernel_numerics())
    summed = residual + x
    return norm(summed), summed
