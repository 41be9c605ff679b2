"""Fixed-order linears: every output row is the same bits whatever the number of rows in the call.

``fixed_order_linear(x, [w0, w1, w2])`` and ``fixed_order_gate_up_silu(x, w_gate, w_up)`` are
``dgpp.kernels.gemv``'s ``multi_linear`` / ``gate_up_silu`` kernels for ANY row count: up to ``MAX_ROWS``
rows the decode GEMV itself, above it the same kernels with the row tile pinned to the policy's ``exact_row_block`` and the
grid's second axis walking row blocks of that size. Every row runs the GEMV's inner tile (whole K in one
program, ``BK``-wide steps in ascending order, one fp32 MMA accumulator), which gives a row
the same bits (checked on the GPU by tests/perf/check_exact_cuda.py) whatever the row class (BM) and tile. cuBLAS (the stock path above 64 rows) picks its kernel
and split-K by ``M``, so a row's last bit followed how many rows shared the step, which flips greedy
near-ties between a speculative verify (1+depth rows per request) and plain decode (one), or between a
one-token prefill chunk and the one-shot prompt.

What may change with ``M`` without changing a row's bits: the grid, and ``BN`` (a wider output tile for
prefill-size calls re-reads x and the weight fewer times; each output element's sum over K is the same
chain of k-steps whatever the tile's width, as ``gemv._tile`` notes). ``DGPP_EXACT_WIDE_BN=0`` keeps the
decode ``BN`` for every ``M`` should the GPU check (``tests/perf/check_exact_cuda.py``) ever show otherwise.
From ``PREFILL_ROWS`` rows on (a burst of short prompts in one call: ``dgpp.nn.exact.routing``) the calls take
``dgpp.kernels.gemm_prefill``: the same per-element chain in GEMM-size tiles. Narrow outputs whose K the decode
GEMV splits (``dgpp.kernels.gemv_split``: by shape and SM count, for every row count) keep the GEMV kernel at
every size instead, so their rows sum the same slices whatever the call.
"""

from __future__ import annotations

import torch

from dgpp.kernels import gemm_prefill, gemv_split
from dgpp.kernels.gemv import MAX_ROWS, _tile, gate_up_silu_triton, multi_linear_triton
from dgpp.policy import current

# the BM of calls above MAX_ROWS rows is the policy's ``exact_row_block`` (up to MAX_ROWS the decode GEMV's own
# row classes, which the H200 showed give the same bits); DGPP_EXACT_ROW_BLOCK 16 or 64, check_exact_cuda.py
# times both
WIDE_ROWS = 256  # from this many rows on, the output tile widens to WIDE_BN
WIDE_BN = 128
GATE_UP_TILE = (128, 4)  # (BK, stages) the stock gate/up launch uses
# from this many rows on, the prefill tiles (dgpp.kernels.gemm_prefill): at 128 rows they ran 145-368 TFLOP/s on the
# 8B shapes against 69-203 in the 64-row GEMV tiles (H200)
PREFILL_ROWS = 128
# fp32 operands (routers kept in fp32) multiply on the CUDA cores, one FMA chain per element in ascending K
# whatever the tile; above the decode sizes they take 64-wide output tiles over 32-wide K steps in two 32 KB
# stages (the decode tiles' 80 KB stages held one latency-bound program per SM: MiMo-V2.6's router over an
# 8,192-token prompt took 47 ms a layer)
FP32_TILE = (64, 32, 2)


def _wide_tile(
    m: int, sizes: list[int], bk: int, stages: int, weight_tiles: int, elem: int, bm: int
) -> tuple[int, int, int] | None:
    """``(WIDE_BN, bk, stages)`` for prefill-size calls whose one pipeline stage fits shared memory, else None
    (the kernel's own tile)."""
    fits = (bm + weight_tiles * WIDE_BN) * bk * elem <= 200 * 1024
    if m >= WIDE_ROWS and fits and current().exact_wide_bn and all(n % WIDE_BN == 0 for n in sizes):
        return WIDE_BN, bk, stages
    return None


def _prefill_size(x: torch.Tensor, sizes: list[int], tile: tuple[int, ...]) -> bool:
    return (
        x.shape[0] >= PREFILL_ROWS
        and current().exact_prefill_tile
        and gemm_prefill.prefill_tile_applies(x, sizes, tile)
    )


def fixed_order_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """True when the fixed-order kernels take these operands (2-D rows, dense contiguous weights, N % 16)."""
    return (
        x.dim() == 2
        and x.shape[0] >= 1
        and x.stride(-1) == 1
        and all(
            w.dim() == 2
            and w.dtype == x.dtype
            and w.shape[1] == x.shape[1]
            and w.shape[0] % 16 == 0
            and w.is_contiguous()
            for w in weights
        )
    )


def fixed_order_linear(
    x: torch.Tensor, weights: list[torch.Tensor], row_block: int | None = None
) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` (1 to 3 weights, one launch), each row independent of ``x.shape[0]``.
    ``row_block`` overrides the policy's ``exact_row_block`` (GPU timing only: the engine must use one value
    everywhere)."""
    bm = row_block or current().exact_row_block
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"fixed_order_linear takes 1 to 3 weights, got {len(weights)}")
    if not fixed_order_applies(x, *weights):
        raise ValueError(
            f"fixed_order_linear: x {tuple(x.shape)} {x.dtype} does not fit weights "
            f"{[tuple(w.shape) for w in weights]} (dense, contiguous, rows a multiple of 16)"
        )
    if row_block is None and x.shape[0] <= MAX_ROWS:
        # the decode GEMV gives these rows the same bits (H200: rows of 1..64-row launches are bit-identical
        # whatever the row class and tile, since the K loop feeds one MMA accumulator in a fixed order) with
        # tiles tuned per row class: 8B decode at batch 1 spent 3.3 ms/step in the 64-row fixed tile, 2.2 there
        return multi_linear_triton(x, weights)
    sizes = [w.shape[0] for w in weights]
    split = gemv_split.split_count(sum(sizes), x.shape[1], gemv_split.device_sms(x))
    # a split shape's rows sum K in slices (the decode GEMV's): the unsplit prefill tile would give other bits
    if row_block is None and split == 1 and _prefill_size(x, sizes, gemm_prefill.linear_tile(x.shape[0])):
        return gemm_prefill.prefill_linear(x, weights)
    if row_block is None and x.dtype == torch.float32 and all(n % FP32_TILE[0] == 0 for n in sizes):
        return multi_linear_triton(x, weights, tile=FP32_TILE, bm=bm)
    _, bk, stages = _tile(sum(sizes), x.shape[1], bm)
    tile = _wide_tile(x.shape[0], sizes, bk, stages, 1, x.element_size(), bm)
    return multi_linear_triton(x, weights, tile=tile, bm=bm)


def fixed_order_gate_up_silu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, row_block: int | None = None
) -> torch.Tensor:
    """``silu(x wg^T) * (x wu^T)`` in one launch, each row independent of ``x.shape[0]``."""
    bm = row_block or current().exact_row_block
    if not fixed_order_applies(x, w_gate, w_up) or w_gate.shape != w_up.shape:
        raise ValueError(
            f"fixed_order_gate_up_silu: x {tuple(x.shape)} does not fit gate {tuple(w_gate.shape)} / "
            f"up {tuple(w_up.shape)}"
        )
    if row_block is None and x.shape[0] <= MAX_ROWS:  # same bits, tuned tiles (see fixed_order_linear)
        return gate_up_silu_triton(x, w_gate, w_up)
    split = gemv_split.split_count(w_gate.shape[0], x.shape[1], gemv_split.device_sms(x))
    tile_ok = _prefill_size(x, [w_gate.shape[0]], gemm_prefill.gate_up_tile(x.shape[0]))
    if row_block is None and split == 1 and tile_ok:  # split shapes keep the GEMV (see fixed_order_linear)
        return gemm_prefill.prefill_gate_up_silu(x, w_gate, w_up)
    tile = _wide_tile(x.shape[0], [w_gate.shape[0]], *GATE_UP_TILE, 2, x.element_size(), bm)
    return gate_up_silu_triton(x, w_gate, w_up, tile=tile, bm=bm)
