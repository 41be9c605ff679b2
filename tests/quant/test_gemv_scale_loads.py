"""How the packed MMA GEMV loads its scales: one K step ahead of the step that uses them (``scales_ahead``, FP8
block and FP4 group scales) or, for FP4, as 32-bit words of four scales (``fp4_scales="words"``, async copies).
Under the Triton interpreter (fp32): each variant gives the bits of the same tile loading its scales in the step
(same decoded values, same K chain), on ragged (masked) and even shapes, whole and split K, at 1..300 rows with the
blocked 64-row tile; and, compiled ahead of time for sm_90, each removes the in-step wait on a global scale load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dgpp.quant.fp4 import MXFP4, FP4Grouped, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.kernels import GemvTile, quant_gate_up_silu, quant_multi_linear

from .gemv_cases import FORMATS, IDS, packed_weights
from .test_packed_batch import assert_rows_exact

FP4 = [NVFP4ModelOpt(), MXFP4()]
# (variant, the same tile with scales loaded in the step): grouped and flat FP4 layouts, per-byte and per-group scales
AHEAD_TILES = [
    GemvTile(bn=16, bk=64),
    GemvTile(bn=16, bk=128, fp4_layout="flat", fp4_scales="gather", w_as_a=False),
    GemvTile(bn=32, bk=128, fp4_layout="flat", fp4_scales="broadcast", w_as_a=False),
]
WORDS_TILE = GemvTile(bn=16, bk=128, fp4_layout="flat", fp4_scales="broadcast", w_as_a=False)


def _same_bits(fmt, base: GemvTile, change: dict, shapes: list[tuple[int, int]]) -> None:
    for n, k in shapes:
        tensors, dense = packed_weights(fmt, n, k, seed=n + k)
        x = torch.randn(20, k)
        for tile in (base, dataclasses.replace(base, split_k=2)):
            variant = dataclasses.replace(tile, **change)
            got = quant_multi_linear(fmt, [tensors], x, [(n, k)], variant)[0]
            torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)
            want = quant_multi_linear(fmt, [tensors], x, [(n, k)], tile)[0]
            assert torch.equal(got, want), f"{fmt.name} {variant}: bits differ from scales loaded in the step"


# every format on the grouped layout; FP4 on the flat one with scales per byte and per group too
AHEAD_CASES = [(f"{i}-grouped", f, AHEAD_TILES[0]) for i, f in zip(IDS, FORMATS, strict=True)] + [
    (f"{i}-flat-{t.fp4_scales}", f, t)
    for i, f in zip(IDS, FORMATS, strict=True)
    if isinstance(f, FP4Grouped)
    for t in AHEAD_TILES[1:]
]


@pytest.mark.parametrize(("fmt", "tile"), [c[1:] for c in AHEAD_CASES], ids=[c[0] for c in AHEAD_CASES])
def test_scales_ahead_keeps_the_bits(fmt, tile):
    """Ragged K and N (masked loads, a last step past the slice) and even ones (the last step's scales re-read)."""
    k = 160 if isinstance(fmt, FP4Grouped) else 200  # not a multiple of the step: the last step is masked
    _same_bits(fmt, tile, {"scales_ahead": True}, [(40, k), (64, 512)])


@pytest.mark.parametrize("fmt", FP4, ids=lambda f: f.name)
def test_scale_words_keep_the_bits(fmt):
    """Words of four group scales (EVEN tiles with four or more groups a step: NVFP4 8, MXFP4 4 at BK 128); a
    ragged shape or fewer groups a step load bytes as ``broadcast`` does."""
    _same_bits(fmt, WORDS_TILE, {"fp4_scales": "words"}, [(64, 512), (40, 256)])
    _same_bits(fmt, dataclasses.replace(WORDS_TILE, bk=64), {"fp4_scales": "words"}, [(32, 256)])


@pytest.mark.parametrize(
    ("fmt", "change"),
    [(FP8Block(block=(16, 64)), {"scales_ahead": True})]
    + [(f, c) for f in FP4 for c in ({"scales_ahead": True}, {"fp4_scales": "words"})],
    ids=["fp8-ahead", "nvfp4-ahead", "nvfp4-words", "mxfp4-ahead", "mxfp4-words"],
)
def test_variant_rows_are_exact_at_any_batch(fmt, change):
    """A row alone == the row among 1..300 rows (the blocked 64-row tile above 16), q/k/v and gate/up launches."""
    n, k = 64, 256
    tile = dataclasses.replace(WORDS_TILE, **change)
    tensors, _ = packed_weights(fmt, n, k, seed=11)
    x = torch.randn(300, k)
    blocked = dataclasses.replace(tile, row_blocks=4)
    assert_rows_exact(fmt, tensors, x, (n, k), tile, blocked)
    up = packed_weights(fmt, n, k, seed=12)[0]
    fused = quant_gate_up_silu(fmt, tensors, up, x[:100], (n, k), tile, blocked)
    assert torch.equal(fused[70], quant_gate_up_silu(fmt, tensors, up, x[70:71], (n, k), tile)[0])


_COVER = """
import dataclasses, json, sys
from bench_quant_gemv import formats
from sass_quant_gemv import _disassemble, compile_tile, global_load_cover, main_loop
from dgpp.quant.kernels import GemvTile
out = {}
for name, label, tile in json.loads(sys.argv[1]):
    loop = main_loop(_disassemble(compile_tile(formats()[name], GemvTile(**tile), (4096, 4096), 16))[0])
    out[f"{name} {label}"] = (len(loop), global_load_cover(loop))
print(json.dumps(out))
"""


def test_scale_loads_stop_waiting_in_their_step_on_sm90():
    """Compiled ahead of time for sm_90 (Triton's ptxas, no GPU; outside the interpreter): a scale load used in its
    own step is read a few instructions after it is issued, so every step waits on global memory; loaded a step
    ahead, it is read at the end of the step (or becomes an async copy), and as words it is an async copy."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    fp4 = dict(bn=128, bk=256, stages=3, warps=8, w_as_a=False, fp4_layout="flat", fp4_scales="broadcast")
    fp8 = dict(bn=32, bk=256, stages=4, warps=4, w_as_a=False, fp8_bits=True)
    tiles = [
        ("nvfp4", "base", fp4),
        ("nvfp4", "ahead", dict(fp4, scales_ahead=True)),
        ("nvfp4", "words", dict(fp4, fp4_scales="words")),
        ("fp8_block", "base", fp8),
        ("fp8_block", "ahead", dict(fp8, scales_ahead=True)),
    ]
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "tests" / "perf"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", _COVER, json.dumps(tiles)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    cover = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("nvfp4", "fp8_block"):
        size, near = cover[f"{name} base"]
        assert near is not None and near < size / 2, (name, size, near)
        size, ahead = cover[f"{name} ahead"]
        assert ahead is None or ahead > 0.8 * size, (name, size, ahead)
    assert cover["nvfp4 words"][1] is None


@pytest.mark.parametrize("fmt", [FP8Block(block=(16, 64)), FP8Block()], ids=["fp8-16x64", "fp8-128"])
def test_fp8_blocked_one_dot_candidate_is_row_exact(fmt):
    """FP8's last 64-row candidate, the blocked tile one dot wide (steps of the chain's width on 2 warps), keeps
    the decode tile's chain: a row alone == the row among 1..300 rows, and the reference's products."""
    from dgpp.quant.kernels.decode_launch import batch_candidates

    n, k = 48, 256
    tile = GemvTile(bn=16, bk=128, w_as_a=False, scales_ahead=True)
    one_dot = batch_candidates(fmt, tile, (n, k))[-1]
    assert (one_dot.row_blocks, one_dot.warps, one_dot.bk) == (4, 2, 64 if fmt.block == (16, 64) else 128)
    tensors, dense = packed_weights(fmt, n, k, seed=13)
    x = torch.randn(300, k)
    got = quant_multi_linear(fmt, [tensors], x, [(n, k)], tile, one_dot)[0]
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert_rows_exact(fmt, tensors, x, (n, k), tile, one_dot)


def test_fp4_decode_tile_loads_scales_ahead_and_its_blocked_tile_in_step():
    """The default FP4 decode tile loads its group scales a step ahead and reads x split once per launch; its blocked
    64-row candidate loads the scales in the step (ahead it spills on sm_90), FP8 tiles in the step. None of these
    choices changes a bit (tests above, and test_x_step_order)."""
    from dgpp.quant.kernels.decode_launch import batch_candidates, default_tile

    for fmt in FP4:
        tile = default_tile(fmt, 24576, 4096, sms=132, weights_per_program=2)
        assert tile.scales_ahead and tile.fp4_scales == "broadcast" and tile.x_split == "launch"
        blocked = [t for t in batch_candidates(fmt, tile, (12288, 4096)) if t.row_blocks == 4]
        assert blocked and not any(t.scales_ahead for t in blocked)
    assert not default_tile(FP8Block(), 4096, 4096, sms=132).scales_ahead
