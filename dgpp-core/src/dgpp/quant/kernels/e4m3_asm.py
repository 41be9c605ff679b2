"""E4M3 bytes -> bf16/fp16 with integer ops instead of the conversion pipe (inline PTX, byte permutes).

Triton's ``fp8e4nv -> bf16`` on sm_90 runs ``cvt e4m3x2 -> f16x2``, then one ``F2F`` f16 -> f32 per weight
and a pack to bf16: the conversion pipe issues 16 results per clock per SM, which is about one weight per
byte of the ~16 bytes per clock an SM must stream at full HBM bandwidth, so FP8 decode GEMVs are bound by
it. Here, for four bytes in one 32-bit register:

1. ``e = r & 0x7F7F7F7F`` drops the signs; ``prmt`` moves bytes 0, 1 (then 2, 3) into the high bytes of two
   16-bit lanes, and a right shift puts the 7 exponent/mantissa bits at bit 4 (bf16) or bit 7 (fp16).
2. The signs come from ``prmt`` of ``r`` itself (bit 15 of each lane), merged with one ``and``/``or``.
3. As bf16 the lane is e4m3 × 2^-120 (E4M3 subnormals land on bf16 subnormals, exactly); as fp16 e4m3 ×
   2^-8. One packed multiply by 2^120 (2^8) restores the value exactly (every result is a normal number).

About 2.5 integer-pipe instructions and half a packed multiply per weight. NaN codes (0x7F/0xFF) decode to
infinities, not NaN; checkpoints do not hold them. ``e4m3_model`` replays the bit steps in Python for the
CPU tests; the GPU benchmark checks the PTX against torch's decode on all 256 codes.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton

LANE_SELECT = (0x1404, 0x3424)  # prmt: bytes (0, 1) resp. (2, 3) of r into the high byte of each 16-bit lane
BF16_SHIFT, FP16_SHIFT = 4, 1  # from bit 8 (the lane's high byte) down to the bf16 resp. fp16 exponent field
BF16_RESTORE, FP16_RESTORE = 0x7B807B80, 0x5C005C00  # 2^120 as bf16x2, 2^8 as fp16x2


def _ptx(shift: int, restore: int, mul: str) -> str:
    return f"""{{
    .reg .b32 e, u0, u1, s0, s1, k;
    mov.b32 k, {restore:#x};
    and.b32 e, $2, 0x7F7F7F7F;
    prmt.b32 u0, e, 0, {LANE_SELECT[0]:#x};
    prmt.b32 u1, e, 0, {LANE_SELECT[1]:#x};
    prmt.b32 s0, $2, 0, {LANE_SELECT[0]:#x};
    prmt.b32 s1, $2, 0, {LANE_SELECT[1]:#x};
    shr.b32 u0, u0, {shift};
    shr.b32 u1, u1, {shift};
    and.b32 s0, s0, 0x80008000;
    and.b32 s1, s1, 0x80008000;
    or.b32 u0, u0, s0;
    or.b32 u1, u1, s1;
    {mul} $0, u0, k;
    {mul} $1, u1, k;
}}"""


# int32 word of four E4M3 codes -> four exact fp32 values (byte i -> $i): two e4m3x2 -> f16x2 conversions,
# then one fp16 -> fp32 conversion per code
_WORD_FP32 = """{
    .reg .b16 lo, hi, a, b, c, d;
    .reg .b32 h01, h23;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 h01, lo;
    cvt.rn.f16x2.e4m3x2 h23, hi;
    mov.b32 {a, b}, h01;
    mov.b32 {c, d}, h23;
    cvt.f32.f16 $0, a;
    cvt.f32.f16 $1, b;
    cvt.f32.f16 $2, c;
    cvt.f32.f16 $3, d;
}"""

if tl is not None:
    _WORD_FP32_PTX = tl.constexpr(_WORD_FP32)
    _BF16_PTX = tl.constexpr(_ptx(BF16_SHIFT, BF16_RESTORE, "mul.rn.bf16x2"))
    _FP16_PTX = tl.constexpr(_ptx(FP16_SHIFT, FP16_RESTORE, "mul.rn.f16x2"))


@triton.jit
def e4m3_values(codes, DOT_DTYPE: tl.constexpr):
    """uint8 E4M3 codes (any shape, >= 4 contiguous per thread) -> exact bf16/fp16 values (GPU only)."""
    if DOT_DTYPE == tl.float16:
        out = tl.inline_asm_elementwise(_FP16_PTX, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(
            _BF16_PTX, "=r,=r,r", [codes], dtype=tl.bfloat16, is_pure=True, pack=4
        )
    return out


@triton.jit
def e4m3_word_fp32(words):
    """int32 words of four E4M3 codes (byte i = column i) -> four exact fp32 tensors, columns 0..3 (GPU only)."""
    return tl.inline_asm_elementwise(
        _WORD_FP32_PTX, "=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 4, is_pure=True, pack=1
    )


@triton.jit
def e4m3_fp32(codes):
    """The same bit placement as portable Triton ops in fp32 (fp32 dots and the interpreter): e4m3 × 2^-120
    as fp32 bits (subnormal codes become fp32 subnormals), times 2^120."""
    b = codes.to(tl.int32)
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36


def e4m3_model(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The PTX above replayed with integer tensors (prmt by byte moves) on a 1-D uint8 tensor of 4k codes."""
    from dgpp.quant.kernels.e2m1_asm import prmt

    shift, restore = (FP16_SHIFT, 2.0**8) if dtype == torch.float16 else (BF16_SHIFT, 2.0**120)
    lanes = []
    for b0, b1, b2, b3 in codes.to(torch.int64).reshape(-1, 4).tolist():
        r = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
        e = r & 0x7F7F7F7F
        for sel in LANE_SELECT:
            word = (prmt(e, 0, sel) >> shift) | (prmt(r, 0, sel) & 0x80008000)
            lanes += [word & 0xFFFF, word >> 16]
    bits = torch.tensor(lanes, dtype=torch.int32).to(torch.int16).view(dtype)
    # the packed multiply: exact, every product is a normal number of the output type
    return (bits.float() * restore).to(dtype)
