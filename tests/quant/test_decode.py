"""Every format decodes stored bits to exactly the values its definition gives (random codes and scales)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dgpp.quant.codecs import e2m1_pack, pack_int32
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import GPTQ, IntPacked

from .reference_codecs import E2M1, E4M3, E8M0, to_f32

GEN = torch.Generator().manual_seed(7)


def _bytes(*shape: int, low: int = 0, high: int = 256) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=GEN, dtype=torch.int32).to(torch.uint8)


def _fp8_codes(n: int, k: int) -> torch.Tensor:
    codes = _bytes(n, k)
    return torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # no NaN codes


def _expected(values64: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(to_f32(values64)).to(dtype)


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(
        got.view(torch.int16 if got.element_size() == 2 else torch.int32),
        want.view(torch.int16 if want.element_size() == 2 else torch.int32),
    )


@pytest.mark.parametrize("scale_format", ["f32", "bf16", "e8m0"])
@pytest.mark.parametrize(
    "shape,block", [((64, 96), (32, 32)), ((40, 72), (16, 32))]
)  # second: partial edge blocks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_values(scale_format, shape, block, dtype):
    n, k = shape
    fmt = FP8Block(block=block, scale_format=scale_format)
    gn, gk = fmt.scale_grid(shape)
    codes = _fp8_codes(n, k)
    if scale_format == "e8m0":
        raw = _bytes(gn, gk, low=100, high=140)
        stored, scale64 = raw.view(torch.float8_e8m0fnu), E8M0[raw.numpy()]
    elif scale_format == "bf16":
        stored = (torch.rand(gn, gk, generator=GEN) * 1e-2).to(torch.bfloat16)
        scale64 = stored.float().double().numpy()
    else:
        stored = torch.rand(gn, gk, generator=GEN) * 1e-2
        scale64 = stored.double().numpy()
    rows, cols = np.arange(n) // block[0], np.arange(k) // block[1]
    want = E4M3[codes.numpy()] * scale64[rows][:, cols]
    tensors = {"weight": codes.view(torch.float8_e4m3fn), "weight_scale_inv": stored}
    fmt.check(tensors, shape, "layer.q_proj")
    _assert_bits_equal(fmt.decode(tensors, shape, dtype), _expected(want, dtype))


def test_fp8_channel_values():
    n, k = 24, 40
    codes = _fp8_codes(n, k)
    scale = torch.rand(n, 1, generator=GEN)
    fmt = FP8Channel()
    want = E4M3[codes.numpy()] * scale.double().numpy()
    got = fmt.decode({"weight": codes, "weight_scale": scale}, (n, k), torch.bfloat16)
    _assert_bits_equal(got, _expected(want, torch.bfloat16))


@pytest.mark.parametrize("fmt", [NVFP4ModelOpt(), NVFP4CompressedTensors(), MXFP4()], ids=lambda f: f.name)
def test_fp4_values(fmt):
    n, k = 16, 64
    codes = _bytes(n, k, high=16)
    groups = k // fmt.group
    tensors = {fmt.data_name: e2m1_pack(codes)}
    if fmt.scale_kind == "e8m0":
        raw = _bytes(n, groups, low=110, high=135)
        tensors[fmt.scale_name], scale64 = raw, E8M0[raw.numpy()]
    else:
        raw = _bytes(n, groups, high=0x7F)  # positive, finite E4M3
        tensors[fmt.scale_name], scale64 = raw.view(torch.float8_e4m3fn), E4M3[raw.numpy()]
    want = E2M1[codes.numpy()] * np.repeat(scale64, fmt.group, axis=1)
    if fmt.global_name:
        g = torch.tensor([3.7e-3 if fmt.global_op == "mul" else 271.3], dtype=torch.float32)
        tensors[fmt.global_name] = g
        want = to_f32(want).astype(np.float64)  # e2m1 × e4m3 is exact in fp32; one more rounding follows
        want = want * float(g) if fmt.global_op == "mul" else want / float(g)
    fmt.check(tensors, (n, k), "mlp.experts.0.up_proj")
    for dtype in (torch.float32, torch.bfloat16):
        _assert_bits_equal(fmt.decode(tensors, (n, k), dtype), _expected(want, dtype))


@pytest.mark.parametrize("bits", [4, 8])
def test_int_packed_values(bits):
    n, k, group = 8, 128, 64
    codes = torch.randint(0, 1 << bits, (n, k), generator=GEN)
    scale = (torch.rand(n, k // group, generator=GEN) * 0.1).to(torch.bfloat16)
    tensors = {
        "weight_packed": pack_int32(codes, bits, dim=1),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k]),
    }
    fmt = IntPacked(bits=bits, group=group)
    fmt.check(tensors, (n, k), "mlp.experts.3.down_proj")
    want = (codes.numpy() - 2 ** (bits - 1)) * np.repeat(scale.float().double().numpy(), group, axis=1)
    _assert_bits_equal(fmt.decode(tensors, (n, k), torch.bfloat16), _expected(want, torch.bfloat16))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_values(bits, act_order):
    n, k, group = 32, 256, 128
    codes = torch.randint(0, 1 << bits, (k, n), generator=GEN)
    zeros = torch.randint(0, 1 << bits, (k // group, n), generator=GEN)
    scales = (torch.rand(k // group, n, generator=GEN) * 0.05).to(torch.float16)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=GEN)]
    tensors = {
        "qweight": pack_int32(codes, bits, dim=0),
        "qzeros": pack_int32(zeros, bits, dim=1),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }
    fmt = GPTQ(bits=bits, group=group)
    fmt.check(tensors, (n, k), "lm_head")
    gi = g_idx.numpy()
    want = ((codes.numpy() - (zeros.numpy()[gi] + 1)) * scales.double().numpy()[gi]).T
    _assert_bits_equal(fmt.decode(tensors, (n, k), torch.float32), _expected(want, torch.float32))
    prepared = fmt.prepare(tensors, (n, k))
    assert ("g_idx" in prepared) == act_order  # a trivial g_idx is dropped, a permuted one kept
    _assert_bits_equal(fmt.decode(prepared, (n, k), torch.float32), _expected(want, torch.float32))
