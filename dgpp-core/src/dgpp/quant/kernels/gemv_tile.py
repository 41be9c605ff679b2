"""The packed decode GEMV's tile (``GemvTile``) and its row limit, shared by the launch (``decode_launch``) and its
row-exactness probe (``batch_probe``)."""

from __future__ import annotations

import dataclasses

MAX_ROWS = 16
FP4_LAYOUTS = ("grouped", "flat")  # GemvTile.fp4_layout, in kernel constexpr order (fp4_tiles.py)
FP4_SCALES = ("gather", "broadcast", "words")
X_SPLITS = ("step", "launch")  # GemvTile.x_split: where FP4 tiles take x's even and odd columns apart


@dataclasses.dataclass(frozen=True)
class GemvTile:
    """BN output rows per program, BK logical K columns per loop step, pipeline stages, warps, and (FP4)
    whether nibbles are interleaved for one dot against contiguous x instead of two stride-2 dots;
    ``w_as_a``: the weight tile is the MMA's A operand (``W x^T``), so each warp owns 16-row weight slices
    and re-reads x from shared memory less often than with x as A (``x W^T``, each warp an 8-row slice)."""

    bn: int = 32
    bk: int = 256
    stages: int = 4
    warps: int = 4
    interleave: bool = False
    w_as_a: bool = True
    fast_fp4: bool = True  # FP4 nibbles decoded by inline PTX (GPU); False: portable Triton bit ops
    split_k: int = 1  # K slices per output tile, summed in a fixed order in the same launch
    fp8_bits: bool = False  # E4M3 -> dot dtype by integer bit placement (e4m3_asm) instead of Triton's cvt
    fp4_layout: str = (
        "grouped"  # "grouped": [BN, groups, G/2] bytes; "flat": [BN, BK/2] as stored (fp4_tiles)
    )
    # flat layout: scales loaded per byte ("gather"), per group + "broadcast", or as 32-bit "words" of four
    # groups (async copies; K steps of four groups or more, else as "broadcast")
    fp4_scales: str = "gather"
    row_blocks: int = (
        1  # 64-row programs: 1, one 64-row dot per step; 4, the 16-row tile's dot on four 16-row blocks
    )
    scales_ahead: bool = False  # FP8 block / FP4 group scales loaded one K step before the step using them
    # FP4 without interleave: x's even and odd columns split by every warp in every K step ("step"), or once per
    # launch by a pre-pass that writes each step's even columns then its odd ones ("launch", x_step_order.py); the
    # same bits either way. The 64-row FP4 candidates take "launch" (decode_launch.batch_candidates)
    x_split: str = "step"
