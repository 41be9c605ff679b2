"""bf12: bit-exact round trip, the documented byte layout, escapes, raw rows, and the engine conversions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.config import EngineConfig
from dgpp.nn.linear import Linear
from dgpp.quant.apply import DualMethod, convert_dense_weights
from dgpp.quant.bf12 import BF12, MAX_ROW_ESCAPES, encode_bf12
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.kernels import quant_matmul
from dgpp.quant.kernels.bf12_gemv import bf12_matmul
from dgpp.quant.linear import QuantLinearMethod


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_round_trip_is_bit_exact_with_escapes_and_raw_rows():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(24, 2048, generator=gen) * 0.02).to(torch.bfloat16)
    w[3, 5] = 0.0  # exponent 0: outside any sane window -> escape
    w[3, 700] = 3.0e4
    w[7, 1000] = -1.0e-30
    w[11, : MAX_ROW_ESCAPES + 1] = 0.0  # too many escapes: the row stays raw
    packed = encode_bf12(w)
    assert packed is not None
    assert packed["raw_rows"].tolist() == [11]
    assert packed["escape_offsets"][4] - packed["escape_offsets"][3] >= 2
    got = BF12().decode(packed, tuple(w.shape), torch.bfloat16)
    assert torch.equal(_bits(got), _bits(w))
    assert packed["packed"].numel() == w.numel() * 2 * 3 // 4  # 12 bits per weight: 0.75 of the bf16 bytes


def test_bf12_kernel_matches_torch_decode():
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(20, 2048, generator=gen) * 0.02).to(torch.bfloat16)
    w[2, 9], w[5, 1500] = 0.0, 2.0e3  # escapes
    w[13, :80] = 0.0  # a raw row
    packed = encode_bf12(w)
    x = torch.randn(3, 2048, generator=gen)
    ref = F.linear(x, BF12().decode(packed, (20, 2048), torch.float32))
    for got in (
        quant_matmul(BF12(), packed, x, (20, 2048)),
        bf12_matmul(packed, x, (20, 2048), bn=8, split_k=2),
    ):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


def test_byte_layout_matches_the_documented_lanes():
    w = torch.full((1, 1024), 1.0, dtype=torch.bfloat16)  # exponent 127 everywhere: base 127 (codes 0)
    w[0, 32 * 5 + 3] = -1.5  # lane 5, sm A byte 3
    w[0, 32 * 5 + 16 + 3] = 4.0  # lane 5, sm B byte 3, exponent 129 -> code 2 in the high nibble
    p = encode_bf12(w)["packed"][0]
    assert int(p[16 * 5 + 3]) == 0x80 | 0x40  # sign | mantissa of 1.5
    assert int(p[512 + 16 * 5 + 3]) == 0x00  # 4.0: sign 0, mantissa 0
    base = int(encode_bf12(w)["base"][0])
    assert int(p[1024 + 16 * 5 + 3]) == ((129 - base) << 4) | (127 - base)


def test_matrix_with_too_many_raw_rows_stays_bf16():
    w = torch.zeros(8, 1024, dtype=torch.bfloat16)
    w[:, ::2] = 1e30  # two far-apart exponents in every row: > 64 escapes everywhere
    w[:, 1::2] = 1e-30
    assert encode_bf12(w) is None


class _Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.up = Linear(1024, 64, dtype=dtype)
        self.down = Linear(64, 1024, dtype=dtype)  # in_features 64: not a bf12 shape, stays bf16


def _tiny(dtype: torch.dtype) -> _Tiny:
    model = _Tiny(dtype)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_bf16_weights_bf12_and_bf12_plus_bf16():
    for mode in ("bf12", "bf12+bf16"):
        model = _tiny(torch.bfloat16)
        dense = model.up.weight.detach().clone()
        done = convert_dense_weights(model, EngineConfig(dense_weights="checkpoint", bf16_weights=mode))
        assert done["bf12"] == 1
        method = model.up.quant_method
        packed = method.packed if isinstance(method, DualMethod) else method
        assert isinstance(packed.fmt, BF12) and (mode == "bf12") == ("weight" not in model.up._parameters)
        assert torch.equal(_bits(packed.dense_weight(model.up, torch.bfloat16)), _bits(dense))
        twin = Linear(1024, 64, dtype=torch.bfloat16)  # the dense layer: what every launch must compute
        twin.weight.data.copy_(dense)
        for rows in (1, 8, 20):  # decode-sized and prefill-sized launches
            x = torch.randn(rows, 1024).to(torch.bfloat16)
            assert torch.equal(model.up(x), twin(x))


def test_dense_weights_fp8_is_explicit_and_converts():
    model = _tiny(torch.float32)
    assert (
        convert_dense_weights(model, EngineConfig(dense_weights="checkpoint", bf16_weights="checkpoint"))[
            "fp8"
        ]
        == 0
    )
    dense = model.up.weight.detach().clone()
    assert (
        convert_dense_weights(model, EngineConfig(dense_weights="fp8", bf16_weights="checkpoint"))["fp8"] == 2
    )
    assert isinstance(model.up.quant_method, QuantLinearMethod) and isinstance(
        model.up.quant_method.fmt, FP8Block
    )
    decoded = model.up.quant_method.dense_weight(model.up, torch.float32)
    assert (decoded - dense).abs().max() <= dense.abs().max() / 8  # E4M3 keeps 3 mantissa bits
