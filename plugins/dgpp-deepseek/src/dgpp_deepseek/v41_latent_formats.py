"""The formats DeepSeek-V4.1-Flash was trained to keep its attention state in, as value roundings.

The release stores (and its training simulated) three low-precision forms; the model's logits depend on them,
so the cache holds the rounded values (exact in bf16 and fp32: a few significant bits times a power of two or
an E4M3 scale):

- the window latents: FP8 E4M3 with a power-of-two (E8M0) scale per 32 channels, the block's amax floored at
  1e-4 (``round_fp8_e8m0``);
- the compressed main entries: FP4 E2M1 with an E4M3 scale per 16 channels, ``amax / 6`` rounded to E4M3 and
  floored at ``2^-9`` (``round_fp4_e4m3``);
- the indexer's queries and keys: FP4 E2M1 with a power-of-two scale per 32 channels (``round_fp4_e8m0``).

Power-of-two scales are ``2^ceil(log2(amax / max))``; E4M3 and E2M1 round to nearest, ties to even.
"""

from __future__ import annotations

import torch

from dgpp.kernels.latent_formats import e2m1_codes, e2m1_values

E4M3_MAX, E2M1_MAX = 448.0, 6.0


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(t))`` for positive fp32 ``t`` (exact: from the float's exponent and mantissa)."""
    mantissa, exponent = torch.frexp(t)  # t = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(t), exponent - (mantissa == 0.5).to(exponent.dtype))


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, within +-6) rounded onto the E2M1 grid, ties to the even code."""
    return e2m1_values(e2m1_codes(x)).to(x.dtype)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, size))


def fp8_e8m0_parts(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The window latent's form: E4M3 codes ``[..., n, block]`` (float8) and a power-of-two fp32 scale
    ``[..., n, 1]``, the block's amax floored at 1e-4."""
    b = _blocks(x, block)
    scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / E4M3_MAX))
    return (b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def round_fp8_e8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The window latent's form as values: E4M3 codes, a power-of-two scale per ``block`` channels."""
    codes, scale = fp8_e8m0_parts(x, block)
    return (codes.float() * scale).flatten(-2).to(x.dtype)


def fp4_e8m0_parts(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's form: E2M1 nibbles ``[..., n, block]`` and a power-of-two fp32 scale ``[..., n, 1]``."""
    b = _blocks(x, block)
    scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-126) * (1.0 / E2M1_MAX))
    return e2m1_codes((b / scale).clamp(-E2M1_MAX, E2M1_MAX)), scale


def fp4_e4m3_parts(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed entries' form: E2M1 nibbles ``[..., n, block]`` and an E4M3 scale (``amax / 6``)
    ``[..., n, 1]``, as fp32."""
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-9)
    scale = (amax / E2M1_MAX).to(torch.float8_e4m3fn).float()
    return e2m1_codes((b / scale).clamp(-E2M1_MAX, E2M1_MAX)), scale


def round_fp4_e8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The indexer's form as values: E2M1 values, a power-of-two scale per ``block`` channels."""
    codes, scale = fp4_e8m0_parts(x, block)
    return (e2m1_values(codes) * scale).flatten(-2).to(x.dtype)


def round_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """The compressed entries' form as values: E2M1 values, an E4M3 scale (``amax / 6``) per ``block``
    channels."""
    codes, scale = fp4_e4m3_parts(x, block)
    return (e2m1_values(codes) * scale).flatten(-2).to(x.dtype)
