"""The CUDA-core row GEMV for packed FP8/FP4 weights (``dgpp.quant.kernels.row_gemv``) under the Triton
interpreter: against the torch decode reference, every row's bits independent of the rows launched with it
(1, 2, 4 and 8 row slots), tile variants, the dispatch rule, and the
logic of its E2M1 -> fp32 PTX replayed in Python. The PTX itself is checked on a GPU by
tests/perf/bench_row_gemv.py."""

from __future__ import annotations

import pytest
import torch

from dgpp.policy import ExecPolicy, install, with_environment
from dgpp.quant.codecs import e2m1_unpack
from dgpp.quant.fp4 import MXFP4, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.kernels import GemvTile, quant_multi_linear
from dgpp.quant.kernels.decode_launch import _row_kernel, decode_kernel
from dgpp.quant.kernels.e2m1_asm import e2m1_fp32_model
from dgpp.quant.kernels.row_launch import RowTile, row_supported, rows_per_program

from .gemv_cases import FORMATS, IDS, packed_weights

SMALL = RowTile(bn=8, bk=64)


def _k(fmt) -> int:
    return 224 if isinstance(fmt, MXFP4) else 208  # not a multiple of the 64-column step: the masked path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 11])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_row_gemv_matches_reference(fmt, rows, dtype):
    n, k = 36, _k(fmt)  # 36 rows: the last 8-row tile is partial
    tensors, dense = packed_weights(fmt, n, k, seed=rows)
    x = torch.randn(rows, k).to(dtype)
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], SMALL)[0]
    assert got.dtype == dtype and got.shape == (rows, n)
    want = x.float() @ dense.t()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the only rounding is the bf16 output (the interpreter upcasts after loading)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(fmt):
    n, k = 24, _k(fmt)
    tensors, _ = packed_weights(fmt, n, k, seed=7)
    x = torch.randn(16, k)
    batched = quant_multi_linear(fmt, [tensors], x, [(n, k)], SMALL)[0]  # two programs of 8 row slots
    for start, size in ((5, 1), (3, 2), (9, 3), (0, 5)):  # 1, 2, 4 and 8 row slots
        part = quant_multi_linear(fmt, [tensors], x[start : start + size], [(n, k)], SMALL)[0]
        assert torch.equal(part, batched[start : start + size])


@pytest.mark.parametrize(
    "tile",
    [
        RowTile(bn=16, bk=128),
        RowTile(bn=4, bk=256, prefetch=False),
        RowTile(bn=8, bk=64, scale_weights=True),
        RowTile(bn=8, bk=128, wide=True),
    ],
    ids=["bn16-bk128", "bn4-bk256-noprefetch", "scale-weights", "wide"],
)
@pytest.mark.parametrize("fmt", [FP8Block(), FP8Channel(), NVFP4ModelOpt(), MXFP4()], ids=lambda f: f.name)
def test_tile_variants(fmt, tile):
    n, k = 32, 256  # K a multiple of every step: the unmasked path
    tensors, dense = packed_weights(fmt, n, k, seed=3)
    x = torch.randn(2, k)
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], tile)[0]
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_dispatch_rule(monkeypatch):
    """The row kernel by default; a GemvTile or DGPP_QUANT_GEMV=mma picks the MMA GEMV; FP4 groups it does
    not cover and K not a multiple of 16 stay on the MMA GEMV."""
    nv, shape = NVFP4ModelOpt(), (32, 256)
    assert _row_kernel(nv, [shape], None)
    assert _row_kernel(nv, [shape], RowTile())
    assert not _row_kernel(nv, [shape], GemvTile())
    monkeypatch.setenv("DGPP_QUANT_GEMV", "mma")
    install(with_environment(ExecPolicy()))  # the override is read once, when the policy is built
    assert not _row_kernel(nv, [shape], None)
    assert not row_supported(FP8Block(), (32, 200))
    assert not row_supported(FP8Block(block=(16, 8)), (32, 256))
    assert row_supported(FP8Channel(), (32, 208))
    assert [rows_per_program(m) for m in (1, 2, 3, 4, 5, 16)] == [1, 2, 4, 4, 8, 8]


@pytest.mark.parametrize(
    ("setting", "max_rows", "fp4", "fp8"),
    [
        ("auto", 1, "row", "row"),
        ("auto", 2, "row", "row"),
        ("auto", 4, "row", "mma"),
        ("auto", 8, "mma", "mma"),
        ("row", 64, "row", "row"),
        ("mma", 1, "mma", "mma"),
    ],
)
def test_engine_choice_is_fixed_by_config_not_by_the_step(monkeypatch, setting, max_rows, fp4, fp8):
    monkeypatch.delenv("DGPP_QUANT_GEMV", raising=False)

    def engine(setting: str) -> None:
        install(
            ExecPolicy.for_engine(batch_invariant=False, quant_decode_gemv=setting, decode_max_rows=max_rows)
        )

    engine(setting)
    assert decode_kernel(NVFP4ModelOpt()) == fp4 and decode_kernel(MXFP4()) == fp4
    assert decode_kernel(FP8Block()) == fp8 and decode_kernel(FP8Channel()) == fp8
    monkeypatch.setenv("DGPP_QUANT_GEMV", "row")  # the A/B override wins
    engine(setting)
    assert decode_kernel(FP8Block()) == "row"
    with pytest.raises(ValueError, match="quant_decode_gemv"):
        engine("fast")


def test_e2m1_fp32_ptx_logic_on_every_byte():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    lo, hi = e2m1_fp32_model(codes)
    want = e2m1_unpack(codes)
    assert torch.equal(lo.view(torch.int32), want[0::2].view(torch.int32))
    assert torch.equal(hi.view(torch.int32), want[1::2].view(torch.int32))
