"""Fixed-order linears: every output row is the same bits whatever the number of rows in the call.

``fixed_order_linear(x, [w0, w1, w2])`` and ``fixed_order_gate_up_silu(x, w_gate, w_up)`` compute what
``dgpp.kernels.gemv``'s ``multi_linear`` / ``gate_up_silu`` compute, for ANY row count: the grid walks
``ROW_BLOCK``-row blocks, and every block runs the GEMV's inner tile (``_gemv_tile``: whole K in one
program, ``BK``-wide steps in ascending order, one fp32 accumulator) with the same ``BM`` whatever ``M``
is. The GEMV instead picks ``BM`` 16/32/64 by row count, and cuBLAS (above 64 rows) picks its kernel
and split-K by ``M``; both make a row's last bit depend on how many rows share the step, which flips
greedy near-ties between a speculative verify (1+depth rows per request) and plain decode (one), or
between a one-token prefill chunk and the one-shot prompt.

What may change with ``M`` without changing a row's bits: the grid, and ``BN`` (a wider output tile
for prefill-size calls re-reads x and the weight fewer times; each output element's sum over K is the
same chain of k-steps whatever the tile's width). ``DGPP_EXACT_WIDE_BN=0`` keeps the decode ``BN`` for
every ``M`` should the GPU check (``tests/perf/check_exact_cuda.py``) ever show otherwise.
"""

from __future__ import annotations

import os

import torch

from dgpp.kernels._triton import tl, triton
from dgpp.kernels.gemv import (
    MAX_ROWS,
    _fit_stages,
    _gemv_tile,
    _precision,
    _tile,
    gate_up_silu_triton,
    multi_linear_triton,
)

# the one BM every call uses, engine-wide: 64 (wgmma-sized on Hopper) or 16 (mma; less work per weight byte at
# batch 1). Either is row-exact, since no call ever picks another; check_exact_cuda.py times both
ROW_BLOCK = int(os.environ.get("DGPP_EXACT_ROW_BLOCK", "64"))
if ROW_BLOCK not in (16, 32, 64):
    raise ValueError(f"DGPP_EXACT_ROW_BLOCK must be 16, 32 or 64, got {ROW_BLOCK}")
WIDE_ROWS = 256  # from this many rows on, the output tile widens to WIDE_BN
WIDE_BN = 128


@triton.jit(do_not_specialize=["m"])  # one compiled kernel for every row count (m == 1 included)
def _fixed_linear_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, m, k_dim, n0, n1, x_stride, out_stride,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    start = tl.program_id(0) * BN  # segments are BN-aligned, so a block never straddles two weights
    w_ptr = w0_ptr
    local = start
    if start >= n0 + n1:
        w_ptr = w2_ptr
        local = start - n0 - n1
    elif start >= n0:
        w_ptr = w1_ptr
        local = start - n0
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    acc = _gemv_tile(x_ptr, w_ptr, m, k_dim, x_stride, rows, local + tl.arange(0, BN), BM, BN, BK, PRECISION)
    out_cols = start + tl.arange(0, BN)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + out_cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] < m)


@triton.jit(do_not_specialize=["m"])
def _fixed_gate_up_silu_kernel(
    x_ptr, wg_ptr, wu_ptr, out_ptr, m, k_dim, x_stride, out_stride,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    gate = _gemv_tile(x_ptr, wg_ptr, m, k_dim, x_stride, rows, cols, BM, BN, BK, PRECISION)
    up = _gemv_tile(x_ptr, wu_ptr, m, k_dim, x_stride, rows, cols, BM, BN, BK, PRECISION)
    # the projections are activations in the model dtype before the product, as in the eager layer
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] < m)


def _widen(bn: int, m: int, sizes: list[int], bk: int, weight_tiles: int, elem: int, bm: int) -> int:
    """The output tile for ``m`` rows: the decode ``bn``, or ``WIDE_BN`` for prefill-size calls whose one
    pipeline stage still fits shared memory (fp32 gate/up would not)."""
    fits = (bm + weight_tiles * WIDE_BN) * bk * elem <= 200 * 1024
    if (m >= WIDE_ROWS and fits and os.environ.get("DGPP_EXACT_WIDE_BN", "1") != "0"
            and all(n % WIDE_BN == 0 for n in sizes)):
        return WIDE_BN
    return bn


def fixed_order_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """True when the fixed-order kernels take these operands (2-D rows, dense contiguous weights, N % 16)."""
    return x.dim() == 2 and x.shape[0] >= 1 and x.stride(-1) == 1 and all(
        w.dim() == 2 and w.dtype == x.dtype and w.shape[1] == x.shape[1] and w.shape[0] % 16 == 0 and w.is_contiguous()
        for w in weights
    )


def fixed_order_linear(x: torch.Tensor, weights: list[torch.Tensor], row_block: int | None = None) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` (1 to 3 weights, one launch), each row independent of ``x.shape[0]``.
    ``row_block`` overrides ``ROW_BLOCK`` (GPU timing only: the engine must use one value everywhere)."""
    bm = row_block or ROW_BLOCK
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"fixed_order_linear takes 1 to 3 weights, got {len(weights)}")
    if not fixed_order_applies(x, *weights):
        raise ValueError(f"fixed_order_linear: x {tuple(x.shape)} {x.dtype} does not fit weights "
                         f"{[tuple(w.shape) for w in weights]} (dense, contiguous, rows a multiple of 16)")
    m, k_dim = x.shape
    if row_block is None and m <= MAX_ROWS:
        # the decode GEMV gives these rows the same bits (H200: rows of 1..64-row launches are bit-identical
        # whatever the row class and tile, since the K loop feeds one MMA accumulator in a fixed order) with
        # tiles tuned per row class: 8B decode at batch 1 spent 3.3 ms/step in this kernel's 64-row tile, 2.2 there
        return multi_linear_triton(x, weights)
    sizes = [w.shape[0] for w in weights]
    n_total = sum(sizes)
    bn, bk, stages = _tile(n_total, k_dim)
    if any(n % bn for n in sizes):
        bn = 16
    bn = _widen(bn, m, sizes, bk, 1, x.element_size(), bm)
    stages = _fit_stages(bm, bn, bk, stages, 1, x.element_size())
    out = torch.empty(m, n_total, dtype=x.dtype, device=x.device)
    padded = list(weights) + [weights[0]] * (3 - len(weights))
    n1 = sizes[1] if len(sizes) > 1 else 0
    _fixed_linear_kernel[(n_total // bn, triton.cdiv(m, bm))](
        x, *padded, out, m, k_dim, sizes[0], n1, x.stride(0), out.stride(0),
        BM=bm, BN=bn, BK=bk, PRECISION=_precision(x), num_warps=4, num_stages=stages,
    )
    return list(out.split(sizes, dim=1))


def fixed_order_gate_up_silu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                             row_block: int | None = None) -> torch.Tensor:
    """``silu(x wg^T) * (x wu^T)`` in one launch, each row independent of ``x.shape[0]``."""
    bm = row_block or ROW_BLOCK
    if not fixed_order_applies(x, w_gate, w_up) or w_gate.shape != w_up.shape:
        raise ValueError(f"fixed_order_gate_up_silu: x {tuple(x.shape)} does not fit gate {tuple(w_gate.shape)} / "
                         f"up {tuple(w_up.shape)}")
    m, k_dim = x.shape
    if row_block is None and m <= MAX_ROWS:  # same bits, tuned tiles (see fixed_order_linear)
        return gate_up_silu_triton(x, w_gate, w_up)
    inter = w_gate.shape[0]
    bn = _tile(2 * inter, k_dim)[0]
    if inter % bn:
        bn = 16
    bk = 256
    bn = _widen(bn, m, [inter], bk, 2, x.element_size(), bm)
    stages = _fit_stages(bm, bn, bk, 3, 2, x.element_size())
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    _fixed_gate_up_silu_kernel[(inter // bn, triton.cdiv(m, bm))](
        x, w_gate, w_up, out, m, k_dim, x.stride(0), out.stride(0),
        BM=bm, BN=bn, BK=bk, PRECISION=_precision(x), num_warps=4, num_stages=stages,
    )
    return out
