"""RMSNorm, optionally fused with the residual add that precedes it.

``rms_norm(x, w, eps)``                   -> ``norm(x) * w``
``rms_norm(x, w, eps, residual=r)``       -> ``(norm(x + r) * w, x + r)``

Numerics follow HF transformers: the residual sum is rounded to the input dtype and the norm is
taken in fp32. Plain weights (Llama/Qwen3): the normalised row is rounded to the input dtype, then
scaled by ``w``. ``weight_offset=1.0`` gives the zero-centred ``(1 + w)`` form (Qwen3-Next/3.5,
Gemma), whose product stays in fp32 and is rounded once; ``fp32_product=True`` keeps that order with
plain weights (``(w · x̂)`` rounded once: gpt-oss / Flint). ``fp32_product`` None: fp32 exactly when
``weight_offset`` is not 0. ``weight`` None: the unweighted ``x̂``; ``out_dtype``: the output's dtype when not
``x``'s (an fp32 ``x̂`` of a bf16 row in one launch, where torch launches the upcast and the norm).
One program normalises one row; the row stays in registers between the add and the norm.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    fp32_product: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if _fp32_product(weight_offset, fp32_product):
        out = (normed * (weight.float() + weight_offset)).to(x.dtype)
    else:
        out = (weight * normed.to(x.dtype)).to(x.dtype)
    return (out, x) if residual is not None else out


def _fp32_product(weight_offset: float, fp32_product: bool | None) -> bool:
    return weight_offset != 0.0 if fp32_product is None else fp32_product


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    x_stride,
    res_stride,
    out_stride,
    res_out_stride,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    FP32_PRODUCT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # upcast right after loading: the interpreter gets bf16 arithmetic wrong, and fp32 is what HF does
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # round the sum to the storage dtype first, as an eager ``x + residual`` would
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = x * tl.rsqrt(var + eps)
    if not FP32_PRODUCT:  # plain weights scale the row after it was rounded to the storage dtype
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        normed *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    tl.store(out_ptr + row * out_stride + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    fp32_product: bool | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None and out_dtype not in (None, x.dtype):
        raise ValueError("rms_norm: a residual sum is written in x's dtype, so the output is too")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, cols = x2.shape
    out = torch.empty(rows, cols, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, shape[-1])
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(out)
    else:
        r2, res_out = x2, out  # unused by the kernel
    block = next_pow2(cols)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight if weight is not None else x2,
            out,
            res_out,
            cols,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            float(eps),
            float(weight_offset),
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            FP32_PRODUCT=_fp32_product(weight_offset, fp32_product),
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    if residual is not None:
        return out.view(shape), res_out.view(shape)
    return out.view(shape)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    fp32_product: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (fused with ``x + residual`` when given); Triton on CUDA, torch elsewhere."""
    fn = rms_norm_triton if use_triton(x) else rms_norm_ref
    return fn(x, weight, eps, residual, weight_offset, fp32_product)


def unweighted_rms_norm(x: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``x̂ = x · rsqrt(mean(x²) + eps)`` over the last dim in fp32, written as ``out_dtype``: one launch on CUDA,
    ``torch.rms_norm`` of the fp32 upcast elsewhere."""
    if not use_triton(x):
        return torch.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(out_dtype)
    out = rms_norm_triton(x, None, eps, fp32_product=True, out_dtype=out_dtype)
    assert isinstance(out, torch.Tensor)  # no residual: one tensor
    return out
