"""Packed decode GEMVs (FP8 block/channel, NVFP4, MXFP4) under the Triton interpreter: against the torch
decode reference, batch invariance, fused q/k/v and gate/up equal to the unfused launches, and the
selection rule (GPU only, 1..16 rows, supported formats)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import IntPacked
from dgpp.quant.kernels import GemvTile, decode_gemv_applies, quant_gate_up_silu, quant_multi_linear
from dgpp.quant.kernels.row_launch import RowTile
from dgpp.quant.linear import shared_decode_format

from .gemv_cases import FORMATS, IDS, packed_layer, packed_weights

SMALL = GemvTile(bn=16, bk=64)


def _k(fmt) -> int:
    return 200 if isinstance(fmt, FP8Block) and not isinstance(fmt, FP8Channel) else 256


def _ref(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return x.float() @ dense.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_decode_gemv_matches_reference(fmt, rows, dtype):
    n, k = 40, _k(fmt)
    tensors, dense = packed_weights(fmt, n, k, seed=rows)
    x = torch.randn(rows, k).to(dtype)
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], SMALL)[0]
    assert got.dtype == dtype and got.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, _ref(x, dense), rtol=1e-5, atol=1e-5)
    else:  # the only rounding is the bf16 output (the interpreter upcasts after loading)
        torch.testing.assert_close(got.float(), _ref(x, dense), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "tile",
    [GemvTile(bn=32, bk=128), GemvTile(bn=16, bk=256, interleave=True), GemvTile(bn=64, bk=32)],
    ids=["bn32-bk128", "bn16-bk256-interleave", "bn64-bk32"],
)
@pytest.mark.parametrize("fmt", [FP8Block(), FP8Channel(), NVFP4ModelOpt(), MXFP4()], ids=lambda f: f.name)
def test_tile_override(fmt, tile):
    n, k = 80, _k(fmt)
    if tile.bk % getattr(fmt, "group", 1):
        pytest.skip("FP4 steps hold whole groups")
    tensors, dense = packed_weights(fmt, n, k, seed=5)
    x = torch.randn(2, k)
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], tile)[0]
    torch.testing.assert_close(got, _ref(x, dense), rtol=1e-5, atol=1e-5)


def test_fp4_tile_must_hold_whole_groups():
    fmt = MXFP4()
    tensors, _ = packed_weights(fmt, 16, 256, seed=0)
    with pytest.raises(ValueError, match="group"):
        quant_multi_linear(fmt, [tensors], torch.randn(1, 256), [(16, 256)], GemvTile(bn=16, bk=16))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_row_does_not_depend_on_batch(fmt):
    n, k = 40, _k(fmt)
    tensors, _ = packed_weights(fmt, n, k, seed=7)
    x = torch.randn(16, k)
    alone = quant_multi_linear(fmt, [tensors], x[:1], [(n, k)], SMALL)[0]
    batched = quant_multi_linear(fmt, [tensors], x, [(n, k)], SMALL)[0]
    assert torch.equal(alone[0], batched[0])


# the two decode GEMVs (MMA and CUDA-core row) share the launch contract: both are checked here
KERNEL_TILES = [SMALL, RowTile(bn=8, bk=64)]
KERNEL_IDS = ["mma", "row"]


@pytest.mark.parametrize("tile", KERNEL_TILES, ids=KERNEL_IDS)
@pytest.mark.parametrize(
    "fmt",
    [FP8Block(block=(16, 64)), FP8Channel(), NVFP4ModelOpt(), NVFP4CompressedTensors()],
    ids=lambda f: f.name,
)
def test_fused_qkv_equals_separate(fmt, tile):
    k = 128
    # 40 and 24 rows are not multiples of the 16-row tile: segments are padded to whole tiles
    shapes = [(48, k), (40, k), (24, k)]
    sets = [packed_weights(fmt, n, k, seed=i)[0] for i, (n, _) in enumerate(shapes)]
    x = torch.randn(3, k)
    fused = quant_multi_linear(fmt, sets, x, shapes, tile)
    for t, s, got in zip(sets, shapes, fused, strict=True):
        assert torch.equal(got, quant_multi_linear(fmt, [t], x, [s], tile)[0])


@pytest.mark.parametrize("tile", KERNEL_TILES, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [FP8Block(block=(16, 64)), NVFP4ModelOpt(), MXFP4()], ids=lambda f: f.name)
def test_fused_gate_up_silu_equals_separate(fmt, dtype, tile):
    n, k = 48, 128
    gate, _ = packed_weights(fmt, n, k, seed=1)
    up, _ = packed_weights(fmt, n, k, seed=2)
    x = torch.randn(4, k).to(dtype)
    got = quant_gate_up_silu(fmt, gate, up, x, (n, k), tile)
    g = quant_multi_linear(fmt, [gate], x, [(n, k)], tile)[0].float()
    u = quant_multi_linear(fmt, [up], x, [(n, k)], tile)[0].float()
    want = (F.silu(g) * u).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_selection_gpu_only_rows_and_formats():
    fmt, n, k = NVFP4ModelOpt(), 32, 128
    t, _ = packed_weights(fmt, n, k, seed=0)
    x = torch.randn(16, k)
    assert decode_gemv_applies(fmt, [t], x, [(n, k)], on_gpu=True)
    assert not decode_gemv_applies(fmt, [t], x, [(n, k)], on_gpu=False)  # CPU keeps the torch path
    assert not decode_gemv_applies(fmt, [t], torch.randn(17, k), [(n, k)], on_gpu=True)  # prefill: wo_matmul
    assert not decode_gemv_applies(fmt, [t], x[:, :64], [(n, k)], on_gpu=True)  # K mismatch
    narrow = FP8Block(block=(16, 8))  # 8-column scale blocks: too narrow for a 16-deep dot
    assert not decode_gemv_applies(narrow, [packed_weights(narrow, n, k, 0)[0]], x, [(n, k)], on_gpu=True)
    ints = IntPacked(bits=4, group=64)
    assert not decode_gemv_applies(ints, [packed_weights(ints, n, k, 0)[0]], x, [(n, k)], on_gpu=True)
    strided = {**t, fmt.data_name: t[fmt.data_name].t().contiguous().t()}
    assert not decode_gemv_applies(fmt, [strided], x, [(n, k)], on_gpu=True)


def test_layers_share_a_launch_only_with_one_format_and_no_bias():
    k = 128
    q, kp, v = (packed_layer(NVFP4ModelOpt(), n, k, i) for i, n in enumerate((64, 32, 32)))
    x = torch.randn(2, k)
    assert shared_decode_format((q, kp, v), x, on_gpu=True) == NVFP4ModelOpt()
    assert shared_decode_format((q, kp, v), x, on_gpu=False) is None
    assert shared_decode_format((q, packed_layer(MXFP4(), 32, k, 3)), x, on_gpu=True) is None
    assert (
        shared_decode_format((q, packed_layer(NVFP4ModelOpt(), 32, k, 4, bias=True)), x, on_gpu=True) is None
    )
    # the layers' resident tensors go through the fused launch and match each layer's own forward
    fused = quant_multi_linear(
        NVFP4ModelOpt(),
        [lyr.quant_method.tensors(lyr) for lyr in (q, kp, v)],
        x,
        [(64, k), (32, k), (32, k)],
        SMALL,
    )
    for lyr, got in zip((q, kp, v), fused, strict=True):
        torch.testing.assert_close(got, lyr(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e2m1_ptx_decoder_logic(dtype):
    """The inline-PTX nibble decoder's tables and selectors (replayed in Python) give every byte's two
    E2M1 values exactly, signed zeros included (the GPU benchmark checks the PTX itself)."""
    from dgpp.quant.codecs import e2m1_unpack
    from dgpp.quant.kernels.e2m1_asm import e2m1_pairs_model

    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    lo, hi = e2m1_pairs_model(every_byte, dtype)
    want = e2m1_unpack(every_byte)
    for got, ref in ((lo, want[0::2]), (hi, want[1::2])):
        assert torch.equal(got.float(), ref)
        assert torch.equal(got.float().signbit(), ref.signbit())


@pytest.mark.parametrize(
    "fmt", [FP8Block(block=(16, 64)), FP8Channel(), NVFP4ModelOpt(), MXFP4()], ids=lambda f: f.name
)
def test_split_k_sums_in_one_launch(fmt):
    """K cut in 2 or 3 slices (3 leaves a ragged last slice): the last program to finish sums the partials;
    equal to the reference, row 0 identical alone and in 16 rows, and the counters are re-armed to 0."""
    from dgpp.kernels.split_partials import _COUNTERS

    n, k = 48, 448 if fmt.name.startswith("fp8") else 512
    gate, dense = packed_weights(fmt, n, k, seed=11)
    up, dense_up = packed_weights(fmt, n, k, seed=12)
    x = torch.randn(16, k)
    for split in (2, 3):
        tile = GemvTile(bn=16, bk=64, split_k=split)
        got = quant_multi_linear(fmt, [gate], x, [(n, k)], tile)[0]
        torch.testing.assert_close(got, _ref(x, dense), rtol=1e-5, atol=1e-5)
        assert torch.equal(quant_multi_linear(fmt, [gate], x[:1], [(n, k)], tile)[0][0], got[0])
        fused = quant_gate_up_silu(fmt, gate, up, x[:3], (n, k), tile)
        want = F.silu(_ref(x[:3], dense)) * _ref(x[:3], dense_up)
        torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
        assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_default_split_depends_on_shape_not_rows():
    from dgpp.quant.kernels import default_tile

    fp8, fp4 = FP8Block(), NVFP4ModelOpt()
    assert default_tile(fp8, 4096, 4096).split_k == 1  # no SM count (CPU): never split
    o_proj = default_tile(fp4, 4096, 4096, sms=132)
    assert o_proj.split_k > 1 and o_proj.split_k & (o_proj.split_k - 1) == 0
    assert default_tile(fp4, 24576, 4096, sms=132, weights_per_program=2).split_k < o_proj.split_k
    assert default_tile(fp8, 4096, 256, sms=132).split_k == 1  # too short a K to cut


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e4m3_bit_decoder_logic(dtype):
    """The integer E4M3 decoder (PTX replayed in Python) gives every code's value exactly, subnormals and
    signed zeros included; NaN codes are excluded (checkpoints do not hold them)."""
    from dgpp.quant.kernels.e4m3_asm import e4m3_model

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] + [0, 0x80], dtype=torch.int32).to(
        torch.uint8
    )
    got = e4m3_model(codes, dtype)
    want = codes.view(torch.float8_e4m3fn).to(dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


FP4_VARIANTS = [
    GemvTile(bn=16, bk=64, fp4_layout="flat"),
    GemvTile(bn=32, bk=128, fp4_layout="flat", fp4_scales="broadcast"),
    GemvTile(bn=16, bk=64, fp4_layout="flat", split_k=3, w_as_a=False),
]


@pytest.mark.parametrize("tile", FP4_VARIANTS, ids=["flat-gather", "flat-broadcast", "flat-split3-x-as-a"])
@pytest.mark.parametrize("fmt", [NVFP4ModelOpt(), MXFP4()], ids=lambda f: f.name)
def test_fp4_flat_layout(fmt, tile):
    """The flat FP4 tile (bytes as stored, scales per byte or per group, x at stride 2): equal to the
    reference on ragged shapes (masks) and even ones, and a row does not depend on the batch."""
    for n, k in ((40, 256), (64, 512)):
        tensors, dense = packed_weights(fmt, n, k, seed=n)
        x = torch.randn(16, k)
        got = quant_multi_linear(fmt, [tensors], x, [(n, k)], tile)[0]
        torch.testing.assert_close(got, _ref(x, dense), rtol=1e-5, atol=1e-5)
        assert torch.equal(quant_multi_linear(fmt, [tensors], x[:1], [(n, k)], tile)[0][0], got[0])


@pytest.mark.parametrize("fmt", [FP8Block(), FP8Block(block=(16, 48)), FP8Channel()], ids=lambda f: f.name)
def test_fp8_bit_decode(fmt):
    """FP8 codes placed as fp32 bits (the fp32 twin of the PTX bit decode) give the reference result."""
    n, k = 40, _k(fmt)
    tensors, dense = packed_weights(fmt, n, k, seed=3)
    x = torch.randn(3, k)
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], GemvTile(bn=16, bk=64, fp8_bits=True))[0]
    torch.testing.assert_close(got, _ref(x, dense), rtol=1e-5, atol=1e-5)
