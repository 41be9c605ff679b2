"""The e4m3 row form of ``engine.kv_dtype: fp8``: quantize K/V rows on their way into the cache, dequantize tiles
on their way out.

A row is one token's one KV head (``head_dim`` values). It is stored as e4m3 codes ``round(x / scale)`` with one
fp32 ``scale = amax(|x|) / 448`` (448 is e4m3's largest finite value; an all-zero row keeps scale 0 and zero
codes), and read back as ``code * scale`` rounded to the compute dtype. Every reader (the torch paths here and
in ``dgpp.nn``, the Triton attention kernels) dequantizes with that one expression, once per loaded tile, so a
key's value never depends on which path or which step read it. Quantizing is row-local: a row's codes do not
depend on the other rows of its step, which keeps chunked prefill, batching and the prefix cache exact.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton
from dgpp.step.cache_spec import KV_FP8

E4M3_MAX = 448.0
KVScales = tuple[torch.Tensor, torch.Tensor] | None  # (k_scale, v_scale) of an e4m3 entry; None: not e4m3


def divide(x: torch.Tensor, constant: float) -> torch.Tensor:
    """``x / constant`` rounded once, on every device. torch's CUDA ``tensor / float`` multiplies by the float
    reciprocal instead (a bit can differ from the CPU's quotient); a tensor divisor divides on both, so a scale
    has the same bits on either device and in the Triton cache writer (``dgpp.kernels.quantized_write``)."""
    return x / torch.full_like(x, constant)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (e4m3 codes ``[..., D]``, fp32 scales ``[..., 1]``), one scale per last-axis row."""
    wide = x.float()
    scale = divide(wide.abs().amax(dim=-1, keepdim=True), E4M3_MAX)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (wide / divisor).clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``code * scale`` in fp32, rounded once to ``dtype`` (what the kernels compute per tile)."""
    return (codes.float() * scales).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a reader of its stored rows sees it (quantized, then dequantized to ``x``'s dtype)."""
    codes, scales = quantize_rows(x)
    return dequantize_rows(codes, scales, x.dtype)


@triton.jit
def dequantize_tile(codes, scale_ptr, rows, mask, dtype: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A loaded tile of e4m3 ``codes`` as ``code * scale`` rounded once to ``dtype``, the scales read at ``rows``
    (where ``mask``): one per column of a transposed key tile ``[D, N]``, else one per row of ``[N, D]``."""
    scale = tl.load(scale_ptr + rows, mask=mask, other=0.0)
    if TRANSPOSED:
        tile = (codes.to(tl.float32) * scale[None, :]).to(dtype)
    else:
        tile = (codes.to(tl.float32) * scale[:, None]).to(dtype)
    return tile
