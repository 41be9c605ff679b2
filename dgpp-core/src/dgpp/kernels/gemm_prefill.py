"""The fixed-order linears at prefill size (thousands of rows): the decode GEMV's arithmetic in GEMM tiles.

``dgpp.nn.exact.gemm`` promises that a row's bits do not depend on how many rows share the call. Up to a few
hundred rows it runs the decode GEMV's own kernels (``dgpp.kernels.gemv``) over 64-row blocks; at prefill size
(a burst of short prompts computed in one call, ``dgpp.nn.exact.routing``) those narrow tiles re-read every
weight once per 64 rows. These kernels compute each output element exactly as the GEMV does (the whole K loop
in one program, ``BK``-wide steps in ascending order, ``acc += dot(x, w^T)`` into one fp32 MMA accumulator,
which Triton folds into the MMA's accumulator operand, so the chain of k-steps is the same whatever ``BK``,
``BM`` and ``BN`` are) in tiles sized for throughput (256 x 128 at thousands of rows, 128 x 128 for gate/up,
which holds two accumulators; narrower for a few hundred rows), a deep pipeline, and programs ordered in groups
of ``GROUP_M`` row blocks so the weight tiles they share stay in L2. ``tests/perf/check_exact_cuda.py`` compares them with the decode GEMV's
rows bit for bit on the GPU.

Rows past ``m`` load row ``m - 1`` (an in-bounds clamp instead of a mask, so the loads stay unmasked): a row's
result depends on its own x row alone, and the store is masked.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton
from dgpp.kernels.gemv import _segment, fit_stages

# (BM, BN, BK, warps, stages, GROUP_M) by row count; H200 sweeps of tests/perf/bench_prefill_gemm.py (2026-12-02,
# TFLOP/s on the 8B shapes): from 1,024 rows 256 x 128 (578-633; cuBLAS 631-726), from 384 rows 128 x 128 (382-573
# at 384-768), below 128 x 64 with 4 warps (145-184 at 128 rows against cuBLAS's 111-311, 282-350 at 256)
LINEAR_TILES = ((1024, (256, 128, 64, 8, 3, 8)), (384, (128, 128, 64, 8, 4, 8)), (0, (128, 64, 64, 4, 4, 8)))
# gate/up holds two accumulators: 128 x 128 ran 368 / 457 / 566 / 553 TFLOP/s at 128 / 256 / 512 / 8,192 rows
# (cuBLAS + SwiGLU 355 / 430 / 605 / 646)
GATE_UP_TILES = ((0, (128, 128, 64, 8, 4, 8)),)


def linear_tile(m: int) -> tuple[int, ...]:
    """The linear tile for ``m`` rows (a tile changes no row's bits, so it may follow the call)."""
    return next(tile for rows, tile in LINEAR_TILES if m >= rows)


def gate_up_tile(m: int) -> tuple[int, ...]:
    return next(tile for rows, tile in GATE_UP_TILES if m >= rows)


@triton.jit
def _block_of(pid, m, n_blocks, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid``: ``GROUP_M`` row blocks walk the column blocks together."""
    m_blocks = tl.cdiv(m, BM)
    per_group = GROUP_M * n_blocks
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(m_blocks - first, GROUP_M)
    local = pid % per_group
    return first + local % size, local // size


@triton.jit
def _x_rows(x_ptr, m, x_stride, rb, BM: tl.constexpr):
    rows = rb * BM + tl.arange(0, BM)
    safe = tl.minimum(rows, m - 1)  # padding rows re-read the last row: their results are never stored
    return rows, x_ptr + safe[:, None].to(tl.int64) * x_stride


@triton.jit(do_not_specialize=["m"])
def _prefill_linear_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    m,
    k_dim,
    n0,
    n1,
    n_blocks,
    x_stride,
    out_stride,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rb, cb = _block_of(tl.program_id(0), m, n_blocks, BM, GROUP_M)
    start = cb * BN  # segments are BN-aligned, so a block never straddles two weights
    w_ptr, local = _segment(start, w0_ptr, w1_ptr, w2_ptr, n0, n1)
    rows, x_rows = _x_rows(x_ptr, m, x_stride, rb, BM)
    w_rows = w_ptr + (local + tl.arange(0, BN))[:, None].to(tl.int64) * k_dim
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, k_dim, BK):  # the GEMV's chain: ascending k-steps into one accumulator
        xk = tl.load(x_rows + (k0 + ks)[None, :])
        wk = tl.load(w_rows + (k0 + ks)[None, :])
        acc += tl.dot(xk, tl.trans(wk), input_precision=PRECISION)
    out_cols = start + tl.arange(0, BN)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * out_stride + out_cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=rows[:, None] < m,
    )


@triton.jit(do_not_specialize=["m"])
def _prefill_gate_up_silu_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    out_ptr,
    m,
    k_dim,
    n_blocks,
    x_stride,
    out_stride,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rb, cb = _block_of(tl.program_id(0), m, n_blocks, BM, GROUP_M)
    cols = cb * BN + tl.arange(0, BN)
    rows, x_rows = _x_rows(x_ptr, m, x_stride, rb, BM)
    ks = tl.arange(0, BK)
    gate = tl.zeros([BM, BN], tl.float32)
    up = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, k_dim, BK):  # one x tile feeds both chains; each is the GEMV's own
        xk = tl.load(x_rows + (k0 + ks)[None, :])
        wg = tl.load(wg_ptr + cols[:, None].to(tl.int64) * k_dim + (k0 + ks)[None, :])
        wu = tl.load(wu_ptr + cols[:, None].to(tl.int64) * k_dim + (k0 + ks)[None, :])
        gate += tl.dot(xk, tl.trans(wg), input_precision=PRECISION)
        up += tl.dot(xk, tl.trans(wu), input_precision=PRECISION)
    # the GEMV kernel's epilogue: the projections rounded to the model dtype, then SwiGLU in fp32
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rows[:, None] < m,
    )


def prefill_tile_applies(x: torch.Tensor, sizes: list[int], tile: tuple[int, ...]) -> bool:
    """The tile needs every output segment a multiple of its ``BN`` and ``K`` a multiple of its ``BK`` (every
    Qwen3 / Llama shape); other shapes keep the GEMV tiles (same bits)."""
    bn, bk = tile[1], tile[2]
    return x.shape[1] % bk == 0 and all(n % bn == 0 for n in sizes)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def prefill_linear(
    x: torch.Tensor, weights: list[torch.Tensor], tile: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` (1 to 3 weights, one launch, outputs are column views of one buffer);
    ``tile`` overrides ``linear_tile`` (sweeps)."""
    bm, bn, bk, warps, stages, group = tile or linear_tile(x.shape[0])
    stages = fit_stages(bm, bn, bk, stages, 1, x.element_size())  # fp32 rows stage twice the bytes
    sizes = [w.shape[0] for w in weights]
    n_total = sum(sizes)
    out = torch.empty(x.shape[0], n_total, dtype=x.dtype, device=x.device)
    padded = list(weights) + [weights[0]] * (3 - len(weights))
    n1 = sizes[1] if len(sizes) > 1 else 0
    n_blocks = n_total // bn
    _prefill_linear_kernel[(n_blocks * triton.cdiv(x.shape[0], bm),)](
        x,
        *padded,
        out,
        x.shape[0],
        x.shape[1],
        sizes[0],
        n1,
        n_blocks,
        x.stride(0),
        out.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=group,
        PRECISION=_precision(x),
        num_warps=warps,
        num_stages=stages,
    )
    return list(out.split(sizes, dim=1))


def prefill_gate_up_silu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, tile: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``silu(x wg^T) * (x wu^T)`` in one launch, gate and up sharing each x tile; ``tile`` as in prefill_linear."""
    bm, bn, bk, warps, stages, group = tile or gate_up_tile(x.shape[0])
    # two weight tiles a step: fp32 rows at 4 stages would stage 288 KB, past the SM's 227 KB
    stages = fit_stages(bm, bn, bk, stages, 2, x.element_size())
    inter = w_gate.shape[0]
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    n_blocks = inter // bn
    _prefill_gate_up_silu_kernel[(n_blocks * triton.cdiv(x.shape[0], bm),)](
        x,
        w_gate,
        w_up,
        out,
        x.shape[0],
        x.shape[1],
        n_blocks,
        x.stride(0),
        out.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=group,
        PRECISION=_precision(x),
        num_warps=warps,
        num_stages=stages,
    )
    return out
