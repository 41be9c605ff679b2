"""E2M1 byte pairs -> bf16/fp16 on NVIDIA GPUs in ~2 instructions per weight (inline PTX, byte permutes).

A byte holds two E2M1 codes (low nibble = even column). For four bytes in one 32-bit register:

1. ``w = r & 0x77777777`` keeps the eight 3-bit magnitudes, one per nibble: nibble i is weight i in K order.
2. ``prmt`` with ``w`` (then ``w >> 16``) as the selector is a table lookup: each selector nibble picks one
   byte of an 8-byte table, so one instruction yields the high bytes (and another the low bytes) of four
   magnitudes as exact bf16 values (0, 0.5, 1, 1.5, 2, 3, 4, 6). fp16 values have zero low bytes.
3. Signs: ``prmt`` in sign-replicate mode turns a selected byte's top bit into 0x00/0xFF; the sign of a
   high nibble is its byte's top bit, and of a low nibble the top bit of that byte in ``r << 4``.
4. Two more ``prmt`` per output register pair the low and high bytes of two weights.

Each output element depends only on its own input byte, so the result does not depend on how Triton
groups elements into registers. ``e2m1_pairs_model`` replays the same tables and selectors in Python
(``prmt`` emulated) so CPU tests check the logic; the GPU benchmark checks the PTX itself.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton

# byte tables (a, b): prmt indexes the 8 bytes {b, a}, a's bytes 0..3 then b's bytes 4..7
BF16_HIGH = (0x3F3F3F00, 0x40404040)  # magnitude 0..7 -> high byte of 0, .5, 1, 1.5 | 2, 3, 4, 6
BF16_LOW = (0xC0800000, 0xC0804000)
FP16_HIGH = (0x3E3C3800, 0x46444240)
FP16_LOW = (0x00000000, 0x00000000)
SIGN_SELECT = (0xD9C8, 0xFBEA)  # sign-replicate selectors over {r, r << 4} for weights 0-3 and 4-7
EVEN_PAIR, ODD_PAIR = 0x6240, 0x7351  # [low, high] bytes of weights (0, 2) and (1, 3) of four


def _signed_high_bytes(src: str, high: tuple[int, int]) -> str:
    """PTX lines that leave in hb0 / hb1 the high bytes of the eight weights of register ``src`` (table ``high``)
    with their signs, and the masked selectors in w / w2 (steps 1-3 above)."""
    return f"""mov.b32 th0, {high[0]:#x};
    mov.b32 th1, {high[1]:#x};
    and.b32 w, {src}, 0x77777777;
    shr.u32 w2, w, 16;
    prmt.b32 hb0, th0, th1, w;
    prmt.b32 hb1, th0, th1, w2;
    shl.b32 r4, {src}, 4;
    prmt.b32 sg0, r4, {src}, {SIGN_SELECT[0]:#x};
    prmt.b32 sg1, r4, {src}, {SIGN_SELECT[1]:#x};
    and.b32 sg0, sg0, 0x80808080;
    and.b32 sg1, sg1, 0x80808080;
    or.b32 hb0, hb0, sg0;
    or.b32 hb1, hb1, sg1;"""


def _ptx(high: tuple[int, int], low: tuple[int, int]) -> str:
    return f"""{{
    .reg .b32 w, w2, r4, hb0, hb1, lb0, lb1, sg0, sg1, th0, th1, tl0, tl1;
    {_signed_high_bytes("$4", high)}
    mov.b32 tl0, {low[0]:#x};
    mov.b32 tl1, {low[1]:#x};
    prmt.b32 lb0, tl0, tl1, w;
    prmt.b32 lb1, tl0, tl1, w2;
    prmt.b32 $0, lb0, hb0, {EVEN_PAIR:#x};
    prmt.b32 $1, lb1, hb1, {EVEN_PAIR:#x};
    prmt.b32 $2, lb0, hb0, {ODD_PAIR:#x};
    prmt.b32 $3, lb1, hb1, {ODD_PAIR:#x};
}}"""


# fp32 outputs: the fp16 high bytes (fp16 E2M1 values have zero low bytes) spread into f16x2 lanes, then
# one exact fp16 -> fp32 conversion per weight; $0..$3 = nibbles 0, 2, 4, 6 (low nibbles of bytes 0..3),
# $4..$7 = nibbles 1, 3, 5, 7
F16_LANES_LOW, F16_LANES_HIGH = (
    0x2404,
    0x3414,
)  # [0, w0, 0, w2] and [0, w1, 0, w3] of four weights' high bytes


def _ptx_fp32() -> str:
    halves = "\n    ".join(f"cvt.f32.f16 ${i}, h{i};" for i in range(8))
    return f"""{{
    .reg .b32 w, w2, r4, hb0, hb1, sg0, sg1, th0, th1, p0, p1, p2, p3;
    .reg .b16 h0, h1, h2, h3, h4, h5, h6, h7;
    {_signed_high_bytes("$8", FP16_HIGH)}
    prmt.b32 p0, hb0, 0, {F16_LANES_LOW:#x};
    prmt.b32 p1, hb1, 0, {F16_LANES_LOW:#x};
    prmt.b32 p2, hb0, 0, {F16_LANES_HIGH:#x};
    prmt.b32 p3, hb1, 0, {F16_LANES_HIGH:#x};
    mov.b32 {{h0, h1}}, p0;
    mov.b32 {{h2, h3}}, p1;
    mov.b32 {{h4, h5}}, p2;
    mov.b32 {{h6, h7}}, p3;
    {halves}
}}"""


if tl is not None:
    _BF16_PTX = tl.constexpr(_ptx(BF16_HIGH, BF16_LOW))
    _FP16_PTX = tl.constexpr(_ptx(FP16_HIGH, FP16_LOW))
    _FP32_PTX = tl.constexpr(_ptx_fp32())


@triton.jit
def e2m1_pairs(packed, DOT_DTYPE: tl.constexpr):
    """uint8 E2M1 pairs (any shape) -> (low-nibble values, high-nibble values) in bf16/fp16, exact."""
    if DOT_DTYPE == tl.float16:
        lo, hi = tl.inline_asm_elementwise(
            _FP16_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        lo, hi = tl.inline_asm_elementwise(
            _BF16_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    return lo, hi


@triton.jit
def e2m1_word_fp32(words):
    """int32 words of eight E2M1 codes (nibble i = column i) -> their exact fp32 values, returned as
    (columns 0, 2, 4, 6, 1, 3, 5, 7): the order the PTX leaves them in (``e2m1_fp32_model``)."""
    return tl.inline_asm_elementwise(
        _FP32_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8, is_pure=True, pack=1
    )


def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` default mode: output byte i = byte (sel_i & 7) of {b, a}, or that byte's top bit
    replicated when sel_i & 8."""
    pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        sel = (selector >> (4 * i)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def e2m1_pairs_model(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The PTX above, step by step in Python, on a 1-D uint8 tensor whose length is a multiple of 4."""
    high, low = (FP16_HIGH, FP16_LOW) if dtype == torch.float16 else (BF16_HIGH, BF16_LOW)
    words = packed.to(torch.int64).reshape(-1, 4)
    lo_bits, hi_bits = [], []
    for b0, b1, b2, b3 in words.tolist():
        r = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
        w = r & 0x77777777
        w2 = w >> 16
        r4 = (r << 4) & 0xFFFFFFFF
        hb0 = prmt(*high, w) | (prmt(r4, r, SIGN_SELECT[0]) & 0x80808080)
        hb1 = prmt(*high, w2) | (prmt(r4, r, SIGN_SELECT[1]) & 0x80808080)
        lb0, lb1 = prmt(*low, w), prmt(*low, w2)
        for reg, out in (
            (prmt(lb0, hb0, EVEN_PAIR), lo_bits),
            (prmt(lb1, hb1, EVEN_PAIR), lo_bits),
            (prmt(lb0, hb0, ODD_PAIR), hi_bits),
            (prmt(lb1, hb1, ODD_PAIR), hi_bits),
        ):
            out += [reg & 0xFFFF, reg >> 16]

    # the registers hold weights of bytes (0, 1) then (2, 3): already byte order
    def as_float(bits: list[int]) -> torch.Tensor:
        return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(dtype)

    return as_float(lo_bits), as_float(hi_bits)


def e2m1_fp32_model(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``e2m1_word_fp32``'s PTX replayed in Python (prmt emulated; fp16 -> fp32 by torch) on 4k bytes: the
    (low-nibble, high-nibble) values of every byte, i.e. outputs 0-3 and 4-7 of each word."""
    lo_bits, hi_bits = [], []
    for b0, b1, b2, b3 in packed.to(torch.int64).reshape(-1, 4).tolist():
        r = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
        w = r & 0x77777777
        r4 = (r << 4) & 0xFFFFFFFF
        hb0 = prmt(*FP16_HIGH, w) | (prmt(r4, r, SIGN_SELECT[0]) & 0x80808080)
        hb1 = prmt(*FP16_HIGH, w >> 16) | (prmt(r4, r, SIGN_SELECT[1]) & 0x80808080)
        lanes = [
            prmt(hb, 0, sel)
            for sel, hb in (
                (F16_LANES_LOW, hb0),
                (F16_LANES_LOW, hb1),
                (F16_LANES_HIGH, hb0),
                (F16_LANES_HIGH, hb1),
            )
        ]
        halves = [half for lane in lanes for half in (lane & 0xFFFF, lane >> 16)]
        lo_bits += halves[:4]
        hi_bits += halves[4:]

    def as_float(bits: list[int]) -> torch.Tensor:
        return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.float16).float()

    return as_float(lo_bits), as_float(hi_bits)
