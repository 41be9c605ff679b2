"""Element codecs shared by the formats: FP8 E4M3, E8M0 exponents, E2M1 nibbles and packed integer words.

Every function here is exact: it turns stored bits into the float32 values the format defines (fp32 holds
every E4M3, E2M1 and E8M0 value exactly), so formats only have to apply their scales.
"""

from __future__ import annotations

import torch

# The E2M1 (FP4) magnitudes for codes 0..7; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = torch.tensor(list(E2M1_MAGNITUDES) + [-v for v in E2M1_MAGNITUDES], dtype=torch.float32)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a one-byte tensor (uint8, int8, float8_*) as uint8 without copying."""
    if t.element_size() != 1:
        raise TypeError(f"expected a one-byte dtype, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def fp8_e4m3_to_float(t: torch.Tensor) -> torch.Tensor:
    """E4M3 (stored as float8_e4m3fn, uint8 or int8) -> float32."""
    return as_bytes(t).view(torch.float8_e4m3fn).to(torch.float32)


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> float32 2^(s-127); s=255 is NaN."""
    return as_bytes(t).view(torch.float8_e8m0fnu).to(torch.float32)


def scale_to_float(t: torch.Tensor, e8m0: bool = False) -> torch.Tensor:
    """A scale tensor as shipped (F32, BF16, F16, E4M3 or E8M0 bytes) -> float32, exactly."""
    if t.dtype == torch.float8_e8m0fnu or (e8m0 and t.element_size() == 1):
        return e8m0_to_float(t)
    if t.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8):
        return fp8_e4m3_to_float(t)
    return t.to(torch.float32)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes (low nibble = even element) -> [..., K] float32 E2M1 values."""
    b = as_bytes(packed).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return _E2M1_TABLE.to(packed.device)[codes]


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes (0..15) -> [..., K/2] uint8, even element in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int32(words: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Split int32 words into 32/bits unsigned codes along ``dim`` (lowest bits = first code)."""
    per_word = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    w = w.movedim(dim, -1)
    codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2).movedim(-1, dim)


def pack_int32(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`: unsigned codes -> int32 words along ``dim``."""
    per_word = 32 // bits
    c = codes.movedim(dim, -1).to(torch.int64)
    if c.shape[-1] % per_word:
        raise ValueError(f"{c.shape[-1]} codes do not fill whole {bits}-bit int32 words")
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per_word, per_word)
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A [ceil(N/bn), ceil(K/bk)] scale grid -> per-element [N, K] (the ceil grid: edge blocks are partial)."""
    n, k = shape
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
