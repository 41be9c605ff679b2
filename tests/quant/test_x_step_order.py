"""FP4 MMA GEMV tiles reading x split once per launch (``x_split="launch"``: a pre-pass writes each K step's even
columns, then its odd ones) instead of every warp splitting each step (``x_split="step"``). Under the Triton
interpreter (fp32): the pre-pass is the permutation it claims (zero padded to whole steps), and every FP4 format,
tile (grouped and flat layouts, x or weights as the MMA's A operand, split K, 64-row blocked and one-dot batch
tiles) and row count gives the bits of the per-step split, on ragged (masked) and even shapes. The decode tile
splits per step and the 64-row candidates once per launch (the defaults); rows stay exact across the two."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.kernels import GemvTile, decode_launch, quant_gate_up_silu, quant_multi_linear
from dgpp.quant.kernels.x_step_order import x_halves

from .gemv_cases import packed_weights
from .test_packed_batch import assert_rows_exact

DECODE_TILES = {
    "grouped": GemvTile(bn=16, bk=64),
    "flat-broadcast-x-as-a": GemvTile(
        bn=32, bk=128, fp4_layout="flat", fp4_scales="broadcast", w_as_a=False, scales_ahead=True
    ),
    "flat-gather-split3": GemvTile(bn=16, bk=64, fp4_layout="flat", split_k=3),
}
ROW_COUNTS = (1, 16, 80)  # one 16-row block, partial and full; a full 64-row block and a partial one


def _step_order(x: torch.Tensor, bk: int) -> torch.Tensor:
    """The layout ``x_halves`` writes, by torch: zero padded to whole steps, each step's even then odd columns."""
    m, k = x.shape
    padded = F.pad(x, (0, -k % bk))
    return padded.view(m, -1, bk // 2, 2).transpose(2, 3).reshape(m, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "bk"), [(256, 64), (160, 64), (96, 128)])
def test_pre_pass_writes_each_step_even_then_odd_columns(k, bk, dtype):
    x = torch.randn(5, 2 * k).to(dtype)[:, :k]  # a row stride wider than K
    got = x_halves(x, bk)
    assert got.shape == (5, -(-k // bk) * bk) and got.dtype == dtype
    assert torch.equal(got, _step_order(x, bk))
    assert torch.equal(got[:, bk // 2], x[:, 1])  # the first odd column opens the step's second half


def _launch(fmt, sets, x, shape, tile, batch, gate_up: bool) -> torch.Tensor:
    if gate_up:
        return quant_gate_up_silu(fmt, sets[0], sets[1], x, shape, tile, batch)
    return quant_multi_linear(fmt, sets[:1], x, [shape], tile, batch)[0]


def _batch_tiles(fmt, tile: GemvTile, shape) -> list[GemvTile]:
    """The 64-row blocked tile (the decode tile's dot on four 16-row blocks) and the one-dot 64-row tile with the
    weights as the MMA's A operand."""
    return [
        dataclasses.replace(tile, row_blocks=4, scales_ahead=False),
        decode_launch.default_batch_tile(fmt, tile, shape),
    ]


# every tile for NVFP4 (ModelOpt: the global scale multiplies) and MXFP4; compressed-tensors NVFP4 (it divides) once
BITS_CASES = [(f, t) for f in (NVFP4ModelOpt(), MXFP4()) for t in DECODE_TILES] + [
    (NVFP4CompressedTensors(), "grouped")
]


@pytest.mark.parametrize(("fmt", "tile_id"), BITS_CASES, ids=[f"{f.name}-{t}" for f, t in BITS_CASES])
def test_split_once_per_launch_gives_the_bits_of_the_split_per_step(fmt, tile_id):
    tile = DECODE_TILES[tile_id]
    for n, k in ((40, 320), (64, 384)):  # ragged N and a last step past K; whole tiles and steps
        sets = [packed_weights(fmt, n, k, seed=n + i)[0] for i in range(2)]
        dense = fmt.decode(sets[0], (n, k), torch.float32)
        x = torch.randn(max(ROW_COUNTS), k)
        per_launch = dataclasses.replace(tile, x_split="launch")
        for rows in ROW_COUNTS:
            for batch in _batch_tiles(fmt, tile, (n, k)) if rows > 16 else [None]:
                launch_batch = batch and dataclasses.replace(batch, x_split="launch")
                step_batch = batch and dataclasses.replace(batch, x_split="step")
                for gate_up in (False, True):
                    got = _launch(fmt, sets, x[:rows], (n, k), per_launch, launch_batch, gate_up)
                    want = _launch(fmt, sets, x[:rows], (n, k), tile, step_batch, gate_up)
                    assert torch.equal(got, want), f"{fmt.name} {tile_id} {n}x{k} rows={rows} {batch}"
            torch.testing.assert_close(
                _launch(fmt, sets, x[:rows], (n, k), per_launch, None, False),
                x[:rows] @ dense.t(),
                rtol=1e-5,
                atol=1e-5,
            )


def test_only_fp4_tiles_that_split_x_run_the_pre_pass(monkeypatch):
    """The pre-pass runs once per FP4 launch with ``x_split="launch"`` (the 64-row candidates' default), and not
    for the per-step split (``GemvTile``'s default), interleaved nibbles (one dot against x in column order) or
    FP8; a decode tile splitting per step and its 64-row candidate splitting per launch keep rows exact."""
    calls = []

    def counted(x, bk):
        calls.append((x.shape[0], bk))
        return x_halves(x, bk)

    monkeypatch.setattr(decode_launch, "x_halves", counted)
    fp4, fp8, k = NVFP4ModelOpt(), FP8Block(block=(16, 64)), 128
    t4, t8 = packed_weights(fp4, 32, k, seed=0)[0], packed_weights(fp8, 32, k, seed=0)[0]
    x = torch.randn(3, k)
    once = GemvTile(bn=16, bk=64, x_split="launch")
    quant_multi_linear(fp4, [t4, t4], x, [(32, k)] * 2, once)
    quant_gate_up_silu(fp4, t4, t4, x, (32, k), once)
    assert calls == [(3, 64), (3, 64)]
    calls.clear()
    quant_multi_linear(fp4, [t4], x, [(32, k)], GemvTile(bn=16, bk=64))
    quant_multi_linear(fp4, [t4], x, [(32, k)], GemvTile(bn=16, bk=64, interleave=True, x_split="launch"))
    quant_multi_linear(fp8, [t8], x, [(32, k)], once)
    assert calls == []
    decode = GemvTile(bn=16, bk=64)
    blocked = decode_launch.batch_candidates(fp4, decode, (32, k))[0]
    assert blocked.row_blocks == 4 and blocked.x_split == "launch" and decode.x_split == "step"
    assert_rows_exact(fp4, t4, torch.randn(300, k), (32, k), decode, blocked)
    assert calls and all(bk == 64 for _, bk in calls)
    with pytest.raises(ValueError, match="x_split"):
        quant_multi_linear(fp4, [t4], x, [(32, k)], GemvTile(bn=16, bk=64, x_split="warp"))


def test_a_wrong_step_order_changes_the_result(monkeypatch):
    """x handed to the tiles in column order instead of step order pairs the wrong columns: the bit comparison
    above and the reference both see it."""
    fmt, n, k = MXFP4(), 32, 128
    tensors, dense = packed_weights(fmt, n, k, seed=1)
    x = torch.randn(4, k)
    tile = GemvTile(bn=16, bk=64, x_split="launch")
    monkeypatch.setattr(decode_launch, "x_halves", lambda rows, bk: F.pad(rows, (0, -rows.shape[1] % bk)))
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], tile)[0]
    want = quant_multi_linear(fmt, [tensors], x, [(n, k)], dataclasses.replace(tile, x_split="step"))[0]
    assert not torch.equal(got, want)
    assert not torch.allclose(got, x @ dense.t(), rtol=1e-3, atol=1e-3)
