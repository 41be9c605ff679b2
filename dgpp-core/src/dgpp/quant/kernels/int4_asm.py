"""int4 codes in int32 words -> their centred values (code - 8) as exact bf16, two weights in 3 instructions.

compressed-tensors ``pack-quantized`` int4 keeps eight codes per word, code ``i`` in bits ``4i..4i+3`` (K order),
so codes ``i`` and ``i + 4`` sit 16 bits apart. ``int4_centred(words, i)`` gives code ``i`` of every word minus 8
in bf16 (inline PTX, one word per element):

1. ``shr``: ``word >> 4 * (i % 4)`` brings codes ``i % 4`` and ``i % 4 + 4`` to bits 0-3 and 16-19;
2. ``lop3``: ``(t & 0x000F000F) | 0x43004300`` makes each half the bf16 ``128 + code`` (bf16 holds the integers
   up to 256 exactly);
3. ``fma.rn.bf16x2``: ``x * 1 - 136`` = ``code - 8`` for both halves, exact.

The PTX returns both halves (codes ``i % 4`` and ``i % 4 + 4``); the two calls that differ only in which half
they keep are the same pure instruction, which the compiler emits once. One element per call keeps the decode
free of Triton's register layout, so it runs in the dot-operand layout the packed words are read in.
Multiplied by a bf16 scale in bf16 (one rounding of the exact product), the weight equals the fp32 product rounded
once to bf16: the decode the torch reference and the fp32 kernel path compute. ``int4_centred_model`` replays the
PTX in Python so CPU tests check the constants; the GPU checks the PTX itself.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton
from dgpp.policy import current

LOW_NIBBLES, MAGIC_128 = 0x000F000F, 0x43004300  # bf16 128.0 = 0x4300: its 7 mantissa bits take the code
ONE, MINUS_136 = 0x3F803F80, 0xC308C308  # bf16x2 (1.0, 1.0) and (-136.0, -136.0)


def _ptx(j: int) -> str:
    shift = f"shr.u32 t, $2, {4 * j};" if j else "mov.b32 t, $2;"
    return f"""{{
    .reg .b32 t, one, off;
    {shift}
    lop3.b32 t, t, {LOW_NIBBLES:#x}, {MAGIC_128:#x}, 0xEA;
    mov.b32 one, {ONE:#x};
    mov.b32 off, {MINUS_136:#x};
    fma.rn.bf16x2 t, t, one, off;
    mov.b32 {{$0, $1}}, t;
}}"""


if tl is not None:
    _P0, _P1, _P2, _P3 = (tl.constexpr(_ptx(j)) for j in range(4))


@triton.jit
def _halves(words, PTX: tl.constexpr):
    return tl.inline_asm_elementwise(
        PTX, "=h,=h,r", [words], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1
    )


@triton.jit
def int4_centred(words, i: tl.constexpr):
    """int32 words (any shape) -> code ``i`` (0..7) of each, minus 8, as bf16."""
    if i % 4 == 0:
        lo, hi = _halves(words, _P0)
    elif i % 4 == 1:
        lo, hi = _halves(words, _P1)
    elif i % 4 == 2:
        lo, hi = _halves(words, _P2)
    else:
        lo, hi = _halves(words, _P3)
    if i < 4:
        out = lo
    else:
        out = hi
    return out


def takes_int4_ptx(
    bits: int, zero_offset: int, scale_dtype: torch.dtype, dot_dtype: object, dot_fp32: bool
) -> bool:
    """Whether a launch decodes with ``int4_centred``: the policy asks for it (``int4_ptx``), the codes are int4
    offset by 8, the scales bf16 and the dots bf16 on the tensor cores (not fp32 dots, as under the interpreter)."""
    return (
        current().int4_ptx
        and bits == 4
        and zero_offset == 8
        and scale_dtype == torch.bfloat16
        and dot_dtype == tl.bfloat16
        and not dot_fp32
    )


def int4_centred_model(words: torch.Tensor, i: int) -> torch.Tensor:
    """The PTX above, step by step in Python, on int32 ``words``: code ``i`` of each minus 8, as fp32."""
    t = (words.to(torch.int64) & 0xFFFFFFFF) >> (4 * (i % 4))
    t = (t & LOW_NIBBLES) | MAGIC_128
    half = (t >> 16) if i >= 4 else (t & 0xFFFF)
    one, off = (
        torch.tensor([ONE & 0xFFFF, MINUS_136 & 0xFFFF], dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        .float()
    )
    return half.to(torch.int32).to(torch.int16).view(torch.bfloat16).float() * one + off
