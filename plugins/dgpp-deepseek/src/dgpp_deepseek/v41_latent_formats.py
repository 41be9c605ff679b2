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

E4M3_MAX, E2M1_MAX = 448.0, 6.0
# E2M1 magnitudes and the midpoints between neighbours; a tie rounds to the even code (codes 0, 2, 4, 6)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(t))`` for positive fp32 ``t`` (exact: from the float's exponent and mantissa)."""
    mantissa, exponent = torch.frexp(t)  # t = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(t), exponent - (mantissa == 0.5).to(exponent.dtype))


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, within +-6) rounded onto the E2M1 grid, ties to the even code."""
    mag = x.abs()
    code = torch.zeros_like(mag, dtype=torch.int64)
    for mid, tie_up in _MIDPOINTS:
        code += (mag >= mid) if tie_up else (mag > mid)
    grid = torch.tensor(_E2M1, dtype=x.dtype, device=x.device)
    return torch.where(torch.signbit(x), -grid[code], grid[code])


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, size))


def round_fp8_e8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The window latent's form: E4M3 codes, a power-of-two scale per ``block`` channels."""
    b = _blocks(x, block)
    scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / E4M3_MAX))
    codes = (b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (codes * scale).flatten(-2).to(x.dtype)


def round_fp4_e8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The indexer's form: E2M1 values, a power-of-two scale per ``block`` channels."""
    b = _blocks(x, block)
    scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-126) * (1.0 / E2M1_MAX))
    return (e2m1_round((b / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale).flatten(-2).to(x.dtype)


def round_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """The compressed entries' form: E2M1 values, an E4M3 scale (``amax / 6``) per ``block`` channels."""
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-9)
    scale = (amax / E2M1_MAX).to(torch.float8_e4m3fn).float()
    return (e2m1_round((b / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale).flatten(-2).to(x.dtype)
