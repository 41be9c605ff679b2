"""int4 words decoded to bf16 in inline PTX (``int4_asm``) for the packed-expert GEMM and the row-exact int GEMM:
the PTX's steps replayed in Python give ``code - 8`` for every sub-position, a bf16 product of those codes and a
bf16 scale equals the fp32 decode rounded once, and the kernels take the path exactly for int4 codes with bf16
scales and bf16 activations, where the policy's ``int4_ptx`` asks for it. (The PTX itself runs only on a GPU: ``tests/perf/check_int4_bf16.py`` compares it
with the fp32 decode bit for bit at real sizes.)"""

from __future__ import annotations

import pytest
import torch

from dgpp.policy import overriding
from dgpp.quant.intq import IntPacked
from dgpp.quant.kernels import int_rows_launch, moe_launch
from dgpp.quant.kernels.int4_asm import int4_centred_model
from dgpp.quant.kernels.launch import _format_args

tl = pytest.importorskip("triton.language")


def test_every_sub_position_is_its_code_minus_8():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (256,), generator=gen, dtype=torch.int64).to(torch.int32)
    words[:4] = torch.tensor([0, -1, 0x76543210, -0x789ABCDF], dtype=torch.int32)  # all-0, all-15, ordered
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    for i in range(8):
        want = ((unsigned >> (4 * i)) & 0xF) - 8
        assert torch.equal(int4_centred_model(words, i), want.float()), i


def test_bf16_product_rounds_as_the_fp32_decode():
    """(code - 8) and a bf16 scale multiply exactly in fp32 (4 + 8 significant bits), so one rounding to bf16 of the
    product is the fp32 decode's value: what a bf16 multiply of the PTX's output and the scale computes."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.arange(16, dtype=torch.float32).repeat(4096) - 8
    scales = torch.rand(codes.shape, generator=gen) * 2.0 ** torch.randint(
        -30, 10, codes.shape, generator=gen
    )
    scales = scales.to(torch.bfloat16)
    exact = codes.double() * scales.double()
    assert torch.equal((codes * scales.float()).double(), exact)  # the fp32 product is exact
    assert torch.equal(
        exact.to(torch.bfloat16), (codes.to(torch.bfloat16) * scales)
    )  # one rounding, both ways


def _int_args(bits: int, scale_dtype: torch.dtype) -> dict:
    n, k = 64, 256
    fmt = IntPacked(bits=bits, group=64)
    tensors = {
        "weight_packed": torch.zeros(n, k * bits // 32, dtype=torch.int32),
        "weight_scale": torch.ones(n, k // 64, dtype=scale_dtype),
    }
    return fmt, tensors, _format_args(fmt, tensors, (n, k))


@pytest.mark.parametrize(
    ("bits", "scale_dtype", "act", "want"),
    [
        (4, torch.bfloat16, "bf16", True),
        (4, torch.float32, "bf16", False),  # a scale that bf16 cannot hold exactly keeps the fp32 decode
        (4, torch.float16, "bf16", False),
        (4, torch.bfloat16, "fp16", False),
        (8, torch.bfloat16, "bf16", False),
    ],
)
def test_the_kernels_take_the_ptx_decode_exactly_for_int4_with_bf16_scales(bits, scale_dtype, act, want):
    fmt, tensors, args = _int_args(bits, scale_dtype)
    dot = {"bf16": tl.bfloat16, "fp16": tl.float16}[act]
    ptrs, row_args = int_rows_launch.int_rows_operands(fmt, tensors, (64, 256))
    with overriding(int4_ptx=False):  # the policy's switch (DGPP_INT4_PTX)
        assert not moe_launch.int4_bf16_applies(args, dot, scale_mode=2, dot_low=True)
        assert not int_rows_launch.int4_bf16_applies(row_args, ptrs[1], False, dot)
    with overriding(int4_ptx=True):
        _assert_applies(args, row_args, ptrs[1], dot, want)


def _assert_applies(args, row_args, scales, dot, want) -> None:
    assert moe_launch.int4_bf16_applies(args, dot, scale_mode=2, dot_low=True) is want
    # per-weight scale gathers
    assert moe_launch.int4_bf16_applies(args, dot, scale_mode=0, dot_low=True) is False
    assert moe_launch.int4_bf16_applies(args, dot, scale_mode=2, dot_low=False) is False  # fp32 dots
    assert int_rows_launch.int4_bf16_applies(row_args, scales, False, dot) is want
    assert int_rows_launch.int4_bf16_applies(row_args, scales, True, dot) is False  # fp32 dots (interpreter)
