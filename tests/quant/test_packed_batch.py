"""Packed FP8 / FP4 linears at serving batch sizes under the Triton interpreter (fp32): above 16 rows the
tensor-core kernel takes every row in one launch, in 64-row blocks that decode each packed tile once. Checked
against the torch decode-then-multiply reference, row-exact (a row alone == the same row among 1..300 rows, bit
for bit), and the row-exactness check itself shown to fail when the K chain is made to depend on the row count."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dgpp.policy import overriding
from dgpp.quant.fp4 import MXFP4, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.kernels import GemvTile, batch_probe, decode_launch, quant_gate_up_silu, quant_multi_linear

from .gemv_cases import FORMATS, IDS, packed_layer, packed_weights

DECODE = GemvTile(bn=16, bk=64)  # the decode tile: it fixes each output's K chain for every row count
SPLIT = dataclasses.replace(DECODE, split_k=2)
ROW_COUNTS = (1, 2, 16, 17, 64, 65, 300)
SAMPLED_ROWS = (0, 1, 15, 16, 17, 63, 64, 65, 130, 299)  # each side of the 16- and 64-row block edges


def _k(fmt) -> int:
    return 200 if isinstance(fmt, FP8Block) and not isinstance(fmt, FP8Channel) else 256


def assert_rows_exact(
    fmt, tensors, x: torch.Tensor, shape, tile: GemvTile, batch: GemvTile | None = None
) -> None:
    """Rows on each side of the block edges, in calls of ``ROW_COUNTS`` rows, are the bits of the row alone."""
    alone = {i: quant_multi_linear(fmt, [tensors], x[i : i + 1], [shape], tile)[0][0] for i in SAMPLED_ROWS}
    for m in ROW_COUNTS:
        got = quant_multi_linear(fmt, [tensors], x[:m], [shape], tile, batch)[0]
        bad = [i for i in SAMPLED_ROWS if i < m and not torch.equal(got[i], alone[i])]
        assert not bad, f"{fmt.name}: rows {bad} of a {m}-row call differ from the row alone"


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_batch_matches_reference(fmt):
    n, k = 72, _k(fmt)
    tensors, dense = packed_weights(fmt, n, k, seed=3)
    x = torch.randn(130, k)
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], DECODE)[0]
    assert got.shape == (130, n)
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [DECODE, SPLIT], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_row_alone_equals_row_among_1_to_300(fmt, tile):
    n, k = 40, _k(fmt)
    tensors, _ = packed_weights(fmt, n, k, seed=9)
    assert_rows_exact(fmt, tensors, torch.randn(300, k), (n, k), tile)


@pytest.mark.parametrize(
    "fmt", [FP8Block(block=(16, 64)), FP8Channel(), NVFP4ModelOpt(), MXFP4()], ids=lambda f: f.name
)
def test_check_fails_when_k_chain_depends_on_rows(fmt, monkeypatch):
    """A batch tile whose dots are half as wide (an M-dependent K order) changes rows' bits: the check sees it,
    and the launch's own probe (``exact_batch_tile``) passes it over for the next candidate, or for 16-row launches."""
    n, k = 40, 256
    tensors, dense = packed_weights(fmt, n, k, seed=4)
    x = torch.randn(300, k)
    narrower = dataclasses.replace(DECODE, bk=DECODE.bk // 2, bn=32)
    monkeypatch.setattr(decode_launch, "_check_batch_tile", lambda *_: None)
    torch.testing.assert_close(
        quant_multi_linear(fmt, [tensors], x, [(n, k)], DECODE, narrower)[0],
        x @ dense.t(),
        rtol=1e-5,
        atol=1e-5,
    )  # still the right products, in another order
    with pytest.raises(AssertionError, match="differ from the row alone"):
        assert_rows_exact(fmt, tensors, x, (n, k), DECODE, narrower)
    default = decode_launch.default_batch_tile(fmt, DECODE, (n, k))
    for candidates, chosen in (([narrower, default], default), ([narrower], None)):
        monkeypatch.setattr(decode_launch, "batch_candidates", lambda *_, c=candidates: c)
        batch_probe._EXACT_BATCH.clear()
        assert_rows_exact(fmt, tensors, x, (n, k), DECODE)
        assert list(batch_probe._EXACT_BATCH.values()) == [chosen]
    batch_probe._EXACT_BATCH.clear()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_blocked_batch_tile_is_the_decode_tiles_dot_on_four_blocks(fmt):
    """64-row programs running the decode tile's own dot on four 16-row blocks (one weight decode for 64 rows):
    the reference's products, and every row the bits of the row alone, fused launches included."""
    n, k = 40, _k(fmt)
    tensors, dense = packed_weights(fmt, n, k, seed=5)
    x = torch.randn(300, k)
    blocked = dataclasses.replace(DECODE, row_blocks=4)
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], DECODE, blocked)[0]
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert_rows_exact(fmt, tensors, x, (n, k), DECODE, blocked)
    assert_rows_exact(fmt, tensors, x, (n, k), SPLIT, dataclasses.replace(blocked, split_k=2))
    up = packed_weights(fmt, n, k, seed=6)[0]
    fused = quant_gate_up_silu(fmt, tensors, up, x[:100], (n, k), DECODE, blocked)
    assert torch.equal(fused[70], quant_gate_up_silu(fmt, tensors, up, x[70:71], (n, k), DECODE)[0])


def test_fp4_probes_the_blocked_tile_first():
    fmt, n, k = NVFP4ModelOpt(), 40, 256
    tensors, _ = packed_weights(fmt, n, k, seed=2)
    batch_probe._EXACT_BATCH.clear()
    quant_multi_linear(fmt, [tensors], torch.randn(70, k), [(n, k)], DECODE)
    assert [t.row_blocks for t in batch_probe._EXACT_BATCH.values()] == [4]
    batch_probe._EXACT_BATCH.clear()


def test_probe_takes_the_fastest_exact_candidate():
    """Of the row-exact candidates the probe keeps the one its timer finds fastest; one that changes rows' bits is
    never taken (nor timed), however fast it would be."""
    fmt, n, k = FP8Block(block=(16, 64)), 40, 256
    tensors, _ = packed_weights(fmt, n, k, seed=3)
    narrower = dataclasses.replace(DECODE, bk=DECODE.bk // 2, bn=32)  # an M-dependent K order: not exact
    blocked = dataclasses.replace(DECODE, row_blocks=4)
    default = decode_launch.default_batch_tile(fmt, DECODE, (n, k))

    def launch(rows, batch):
        return quant_multi_linear(fmt, [tensors], rows, [(n, k)], DECODE, batch)[0]

    def probe(key, times):
        timed = []

        def timer(run, device):
            timed.append(run())  # the timed launch runs the candidate
            return times[len(timed) - 1]

        chosen = batch_probe.exact_batch_tile(
            key, launch, [default, narrower, blocked], k, torch.float32, torch.device("cpu"), timer
        )
        return chosen, len(timed)

    batch_probe._EXACT_BATCH.clear()
    assert probe("slower first", [3.0, 2.0]) == (blocked, 2)  # default and blocked timed, the inexact one not
    assert probe("faster first", [1.0, 2.0]) == (default, 2)
    assert probe("ties", [0.0, 0.0]) == (default, 2)  # equal times: the earlier candidate
    batch_probe._EXACT_BATCH.clear()


def test_batch_tile_must_keep_the_chain():
    fmt, n, k = FP8Block(block=(16, 64)), 32, 256
    tensors, _ = packed_weights(fmt, n, k, seed=0)
    with pytest.raises(ValueError, match="K chain"):
        quant_multi_linear(
            fmt, [tensors], torch.randn(20, k), [(n, k)], DECODE, batch=dataclasses.replace(DECODE, bk=32)
        )


@pytest.mark.parametrize("tile", [DECODE, SPLIT], ids=["whole-k", "split-k"])
@pytest.mark.parametrize(
    "fmt", [FP8Block(block=(16, 64)), FP8Channel(), NVFP4ModelOpt(), MXFP4()], ids=lambda f: f.name
)
def test_fused_launches_at_batch(fmt, tile):
    """q/k/v side by side and gate/up + SwiGLU over 100 rows: each equals its own launch, rows equal alone."""
    k = 128
    shapes = [(48, k), (40, k), (24, k)]
    sets = [packed_weights(fmt, n, k, seed=i)[0] for i, (n, _) in enumerate(shapes)]
    x = torch.randn(100, k)
    fused = quant_multi_linear(fmt, sets, x, shapes, tile)
    for t, s, got in zip(sets, shapes, fused, strict=True):
        assert torch.equal(got, quant_multi_linear(fmt, [t], x, [s], tile)[0])
        assert torch.equal(got[7], quant_multi_linear(fmt, [t], x[7:8], [s], tile)[0][0])
    gate, up = sets[0], packed_weights(fmt, 48, k, seed=8)[0]
    got = quant_gate_up_silu(fmt, gate, up, x, (48, k), tile)
    g = quant_multi_linear(fmt, [gate], x, [(48, k)], tile)[0]
    u = quant_multi_linear(fmt, [up], x, [(48, k)], tile)[0]
    torch.testing.assert_close(got, F.silu(g) * u, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[70], quant_gate_up_silu(fmt, gate, up, x[70:71], (48, k), tile)[0])


@pytest.mark.parametrize(("kernel", "launches"), [("mma", 1), ("row", 4)])
def test_canonical_rows_take_one_launch_on_the_tensor_core_kernel(kernel, launches, monkeypatch):
    """Decode rows of a 64-row step: one launch for all rows under the MMA kernel (each weight read once per
    64-row block), launches of 16 rows under the row GEMV; both equal the layer's reference."""
    from dgpp.quant import linear

    fmt, n, k = NVFP4ModelOpt(), 32, 128
    layer = packed_layer(fmt, n, k, seed=2)
    calls = []
    real = linear.quant_multi_linear
    monkeypatch.setattr(
        linear, "quant_multi_linear", lambda *a, **kw: calls.append(a[2].shape[0]) or real(*a, **kw)
    )
    x = torch.randn(64, k)
    with overriding(quant_decode_gemv=kernel):
        sets, shapes = linear.layer_tensors((layer,))
        got = linear.decode_rows(fmt, sets, x, shapes)[0]
    assert len(calls) == launches and sum(calls) == 64
    want = x @ fmt.decode(sets[0], shapes[0], torch.float32).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
