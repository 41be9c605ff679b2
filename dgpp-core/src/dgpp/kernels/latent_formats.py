"""The MLA latent cache's quantized forms under ``engine.kv_dtype`` (the original engine's latent formats,
github.com/HawkBearPig/dgpp ``src/kernels/latent_format.hpp``): a token's normed latent row of ``L`` values is
written once and read by every later attention over that token, so it is quantized on write and every reader
dequantizes the same way.

- ``fp8``: ``L`` e4m3 codes with one fp32 row scale ``amax / 448`` (``dgpp.kernels.kv_fp8``'s row form); half the
  bf16 bytes, about 2^-4 relative error per element.
- ``fp4``: e2m1 codes, two per byte (the low nibble is the even element), in blocks of 16 values each with an
  e4m3 block-scale byte, stored in the row after the codes, the row padded to 16 bytes (``L/2 + L/16`` bytes,
  288 at ``L`` 512); beside it one fp32 row scale ``s_r = amax / (6 · 448)``. A block's scale code is
  ``e4m3(block_amax · 448 / amax)``, so its value ``S = e4m3 · s_r`` brings the block's largest element near 6;
  codes are ``e2m1(x / S)`` rounded to nearest, ties to the even code, saturating at 6. About 2^-2 relative error
  per element.

A reader computes ``e2m1 · (e4m3 · s_r)`` (fp4) or ``e4m3 · s_r`` (fp8) in fp32 and rounds once to the compute
dtype; the Triton MLA kernel (``dgpp.kernels.mla_attention``) does the same products in the same order, so a latent
reads the same bits from either path. The rotated key part (``k_rot``) is not quantized: positions keep their
precision, as in the original. Quantizing is row-local, so chunking, batching and prefix hits stay exact. On CUDA
the cache write is ``dgpp.kernels.quantized_write``, one launch that stores the bytes ``quantize_latent`` gives.
"""

from __future__ import annotations

import torch

from dgpp.kernels.kv_fp8 import E4M3_MAX, dequantize_rows, divide, quantize_rows
from dgpp.step.cache_spec import FP4_BLOCK, KV_FP8, fp4_row_bytes

E2M1_MAX = 6.0
# the rounding edges between neighbouring magnitudes; at an exact tie the even code wins, so the edge is
# ">" where the lower neighbour is even and ">=" where the upper one is
_EDGES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def latent_format_of(stored: torch.Tensor) -> str:
    """The format a latent pool tensor holds: ``fp8`` (e4m3 codes), ``fp4`` (packed bytes) or the compute dtype."""
    if stored.dtype == KV_FP8:
        return "fp8"
    return "fp4" if stored.dtype == torch.uint8 else "compute"


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` -> e2m1 codes (uint8, sign in bit 3), nearest with ties to even, saturating at 6."""
    magnitude = x.abs()
    code = torch.zeros_like(x, dtype=torch.uint8)
    for edge, inclusive in _EDGES:
        code += (magnitude >= edge if inclusive else magnitude > edge).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes -> fp32 values, by bit placement (no table: nothing is copied to the device, so a CUDA graph
    can capture it): the sign to fp16's bit 15 and the exponent/mantissa bits to bits 9..11 read as
    ``value * 2^-14`` (e2m1's subnormal 0.5 lands on fp16's), exact in fp32 after the power-of-two rescale."""
    wide = code.to(torch.int32)
    bits = ((wide & 7) << 9) | ((wide & 8) << 12)
    return bits.to(torch.int16).view(torch.float16).float() * 16384.0


def e4m3_values(code: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (uint8) -> fp32 values."""
    return code.view(KV_FP8).float()


def quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., L]`` -> (packed rows uint8 ``[..., fp4_row_bytes(L)]``, fp32 row scales ``[..., 1]``)."""
    latent_dim = x.shape[-1]
    wide = x.float()
    amax = wide.abs().amax(dim=-1, keepdim=True)
    row_scale = divide(amax, E2M1_MAX * E4M3_MAX)
    inverse = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, 1.0), 0.0)
    blocks = wide.unflatten(-1, (latent_dim // FP4_BLOCK, FP4_BLOCK))
    block_amax = blocks.abs().amax(dim=-1)
    scale_codes = (block_amax * inverse).clamp(max=E4M3_MAX).to(KV_FP8).view(torch.uint8)
    block_scale = e4m3_values(scale_codes) * row_scale  # S, the block's absolute scale
    block_inverse = torch.where(block_scale > 0, 1.0 / torch.where(block_scale > 0, block_scale, 1.0), 0.0)
    codes = e2m1_codes(blocks * block_inverse[..., None]).flatten(-2)
    packed = torch.zeros(*x.shape[:-1], fp4_row_bytes(latent_dim), dtype=torch.uint8, device=x.device)
    packed[..., : latent_dim // 2] = codes[..., 0::2] | (codes[..., 1::2] << 4)
    packed[..., latent_dim // 2 : latent_dim // 2 + latent_dim // FP4_BLOCK] = scale_codes
    return packed, row_scale


def dequantize_fp4(
    packed: torch.Tensor, row_scale: torch.Tensor, latent_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """Packed fp4 rows and their row scales -> ``[..., latent_dim]`` in ``dtype``: ``e2m1 · (e4m3 · s_r)`` in fp32."""
    half = latent_dim // 2
    codes = torch.stack((packed[..., :half] & 15, packed[..., :half] >> 4), dim=-1).flatten(-2)
    scale_codes = packed[..., half : half + latent_dim // FP4_BLOCK]
    block_scale = e4m3_values(scale_codes) * row_scale  # [..., L/16]
    values = e2m1_values(codes).unflatten(-1, (latent_dim // FP4_BLOCK, FP4_BLOCK)) * block_scale[..., None]
    return values.flatten(-2).to(dtype)


def quantize_latent(x: torch.Tensor, latent_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows ``x [..., L]`` -> (stored rows, fp32 row scales ``[..., 1]``) in ``fp8`` or ``fp4``."""
    return quantize_rows(x) if latent_format == "fp8" else quantize_fp4(x)


def dequantize_latent(
    stored: torch.Tensor, scale: torch.Tensor | None, latent_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """Stored latent rows (any leading shape) -> ``[..., latent_dim]`` in ``dtype`` (as is in the compute dtype)."""
    fmt = latent_format_of(stored)
    if fmt == "compute" or scale is None:
        return stored.to(dtype)
    if fmt == "fp8":
        return dequantize_rows(stored, scale, dtype)
    return dequantize_fp4(stored, scale, latent_dim, dtype)
