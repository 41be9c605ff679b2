"""Independent float64 decoders of the element formats, written from their bit-field definitions.

They deliberately share no code with ``dgpp.quant`` (no torch float8 casts), so a decoder bug cannot hide.
"""

from __future__ import annotations

import math

import numpy as np


def e4m3(byte: int) -> float:
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return math.nan
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def e2m1(code: int) -> float:
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if s else v


def e8m0(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


E4M3 = np.array([e4m3(b) for b in range(256)])
E2M1 = np.array([e2m1(c) for c in range(16)])
E8M0 = np.array([e8m0(b) for b in range(256)])


def to_f32(x64: np.ndarray) -> np.ndarray:
    """Correctly rounded float64 -> float32 (numpy rounds to nearest even)."""
    return x64.astype(np.float32)
