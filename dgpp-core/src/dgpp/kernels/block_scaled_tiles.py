"""Tile loaders for rows stored block-scaled, decoded in registers to the values a torch decode of the same bytes
gives: ``code * scale`` in fp32 (exact: a few significant bits times a power of two or an E4M3 scale), rounded once
to the compute dtype.

A row's bytes are its codes, then one scale byte per ``BLOCK`` values:

- FP4: E2M1 nibble pairs (value ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high one), ``dim / 2``
  bytes, scaled by an E4M3 byte or a power of two's biased exponent (E8M0, ``2^(byte - 127)``);
- FP8: one E4M3 byte per value, ``dim`` bytes, scaled by an E8M0 byte.

A loader takes the row bytes twice, as ``uint8`` and as ``float8_e4m3fn`` (two views of one tensor): E4M3 bytes
are read through the float8 view, nibbles and exponents through the byte view. ``rows`` are each row's element
offset, ``cols`` the value columns of the tile; where ``mask`` is false the tile holds zeros and nothing is read.
"""

from __future__ import annotations

from typing import NamedTuple

from dgpp.kernels._triton import tl, triton


class PackedKeyForms(NamedTuple):
    """How a compressed layer's window ring and entry pool hold their latent rows: the ring FP8 with an E8M0 scale
    per ``ring_block`` values, the entries FP4 with an E4M3 (or, ``entry_e8m0``, E8M0) scale per ``entry_block``."""

    ring_block: int = 32
    entry_block: int = 16
    entry_e8m0: bool = False


@triton.jit
def e2m1_value(code):
    """E2M1 codes (int32, sign in bit 3) -> fp32 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    step = (code & 7) >> 1
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(
        step == 0,
        0.5 * mantissa,
        (2.0 + mantissa) * tl.where(step == 1, 0.5, tl.where(step == 2, 1.0, 2.0)),
    )
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def e8m0_value(byte):
    """E8M0 scale bytes (1 .. 254, as the writers store them) -> ``2^(byte - 127)`` in fp32, from the bits."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def packed_fp4_tile(
    u8_ptr, f8_ptr, rows, cols, mask, dim, dtype: tl.constexpr, BLOCK: tl.constexpr, E8M0: tl.constexpr
):
    """``[N, C]`` values of FP4 rows: nibble ``cols`` of each row times its block's scale byte."""
    packed = tl.load(u8_ptr + rows[:, None] + (cols // 2)[None, :], mask=mask, other=0).to(tl.int32)
    code = tl.where((cols % 2)[None, :] == 1, packed >> 4, packed & 15)
    at = rows[:, None] + (dim // 2 + cols // BLOCK)[None, :]
    if E8M0:
        scale = e8m0_value(tl.load(u8_ptr + at, mask=mask, other=127))
    else:
        scale = tl.load(f8_ptr + at, mask=mask, other=0.0).to(tl.float32)
    return (e2m1_value(code) * scale).to(dtype)


@triton.jit
def packed_fp8_tile(u8_ptr, f8_ptr, rows, cols, mask, dim, dtype: tl.constexpr, BLOCK: tl.constexpr):
    """``[N, C]`` values of FP8 rows: E4M3 byte ``cols`` of each row times its block's power-of-two scale."""
    codes = tl.load(f8_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = e8m0_value(tl.load(u8_ptr + rows[:, None] + (dim + cols // BLOCK)[None, :], mask=mask, other=127))
    return (codes * scale).to(dtype)
