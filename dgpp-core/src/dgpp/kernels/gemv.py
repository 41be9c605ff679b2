"""Decode-size linear layers (``M <= 64`` rows): several weights in one launch, and gate/up + SwiGLU.

At batch 1..64 a linear layer is a matrix-vector product bound by reading its weight once. cuBLAS
picks split-K kernels plus a separate reduction for the small decode shapes (and reaches ~40% of
the copy bandwidth on the 1024x4096 K/V projections). These kernels stream each weight tile once,
with the whole ``K`` loop in one program or, for narrow outputs, in slices fixed by the shape (either
way the sum order is fixed and results repeat bit for bit), and fuse what decode runs back to back:

``multi_linear(x, [w0, w1, w2])`` -> ``[x w0^T, x w1^T, x w2^T]`` (q/k/v projections, one launch; the
outputs are column views of one buffer). ``gate_up_silu(x, w_gate, w_up)`` -> ``silu(x wg^T) * (x wu^T)``
(the MLP's first half, one launch, the activation never stored in between).

``x [M, K]``, weights ``[N_i, K]`` contiguous, ``N_i`` multiples of 16. ``DGPP_GEMV=0`` turns them off.

Outputs narrower than ``gemv_split.FILLING_COLUMNS`` (4096; a gate/up pair by its intermediate width) would
leave most SMs idle with one program per 16-column tile, so their launches split K into slices set by the
shape and the SM count (never by the row count): each slice's fp32 partial is summed with the others in slice
order by the tile's last program (the ``*_split_kernel``s, ``dgpp.kernels.gemv_split``). Wider outputs keep
the unsplit kernels.

Row tiles: 1..16 rows run with BM=16, 17..32 with BM=32, 33..64 with BM=64 (at batch 64 cuBLAS picks
split-K plus a reduction for down/q/o). Within one BM every row's result is independent of how many other
rows share the launch, bit for bit: padding rows are masked loads of zeros and the K loop order is fixed.
So a row computed with 1..16 rows is identical for every count in 1..16 (MTP verify relies on it), and
likewise within 17..32 and within 33..64. Across BM classes (16 vs 32 vs 64 rows) equality is NOT
guaranteed: the tensor-core instruction chosen for the dot depends on BM (mma vs wgmma on Hopper), and
its internal accumulation order may differ; ``tests/perf/check_kernels.py`` reports whether it held on
the device. The values agree to fp32-accumulation rounding either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels import gemv_split
from dgpp.kernels._triton import tl, triton, use_triton
from dgpp.kernels.split_partials import (
    arrive_last,
    gather_partials,
    k_slice_range,
    publish_partial,
    row_block_ptrs,
)
from dgpp.policy import current

MAX_ROWS = 64


def multi_linear_ref(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.linear(x, w) for w in weights]


def gate_up_silu_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return (F.silu(F.linear(x, w_gate).float()) * F.linear(x, w_up).float()).to(x.dtype)


@triton.jit
def _gemv_tile(
    x_ptr,
    w_ptr,
    m,
    k_dim,
    k_lo,
    k_hi,
    x_stride,
    rows,
    cols,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The fp32 ``[BM, BN]`` product over K columns ``k_lo:k_hi`` (the whole row unless split), in ascending
    ``BK`` steps into one accumulator; ``k_dim`` is the weight's row length."""
    acc = tl.zeros([BM, BN], tl.float32)
    ks = tl.arange(0, BK)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + ks
        kmask = kk < k_hi
        xk = tl.load(
            x_ptr + rows[:, None] * x_stride + kk[None, :],
            mask=(rows[:, None] < m) & kmask[None, :],
            other=0.0,
        )
        wk = tl.load(w_ptr + cols[:, None].to(tl.int64) * k_dim + kk[None, :], mask=kmask[None, :], other=0.0)
        acc += tl.dot(xk, tl.trans(wk), input_precision=PRECISION)
    return acc


@triton.jit
def _segment(start, w0_ptr, w1_ptr, w2_ptr, n0, n1):
    """The weight that output column ``start`` of ``[w0 | w1 | w2]`` falls in, and the column within it."""
    w_ptr = w0_ptr
    local = start
    if start >= n0 + n1:
        w_ptr = w2_ptr
        local = start - n0 - n1
    elif start >= n0:
        w_ptr = w1_ptr
        local = start - n0
    return w_ptr, local


@triton.jit(do_not_specialize=["m"])  # one compiled kernel for every row count (dgpp.nn.exact.gemm)
def _multi_linear_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    m,
    k_dim,
    n0,
    n1,
    x_stride,
    out_stride,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start = tl.program_id(0) * BN  # segments are BN-aligned, so a block never straddles two weights
    w_ptr, local = _segment(start, w0_ptr, w1_ptr, w2_ptr, n0, n1)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)  # grid axis 1: row blocks (one for decode calls)
    acc = _gemv_tile(
        x_ptr, w_ptr, m, k_dim, 0, k_dim, x_stride, rows, local + tl.arange(0, BN), BM, BN, BK, PRECISION
    )
    out_cols = start + tl.arange(0, BN)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * out_stride + out_cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=rows[:, None] < m,
    )


@triton.jit(do_not_specialize=["m"])
def _multi_linear_split_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    m,
    k_dim,
    k_per_split,
    n0,
    n1,
    x_stride,
    out_stride,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``_multi_linear_kernel`` with K cut into SPLIT slices (grid axis 1; row blocks on axis 2): each program's
    fp32 partial goes to the workspace, and the tile's last program to arrive stores the partials' sum taken in
    slice order (``dgpp.kernels.gemv_split``)."""
    start = tl.program_id(0) * BN
    w_ptr, local = _segment(start, w0_ptr, w1_ptr, w2_ptr, n0, n1)
    x_ptr, out_ptr, m = row_block_ptrs(x_ptr, out_ptr, m, x_stride, out_stride, BM)
    k_lo, k_hi = k_slice_range(k_dim, k_per_split)
    rows = tl.arange(0, BM)
    cols = local + tl.arange(0, BN)
    acc = _gemv_tile(x_ptr, w_ptr, m, k_dim, k_lo, k_hi, x_stride, rows, cols, BM, BN, BK, PRECISION)
    publish_partial(ws_ptr, tl.trans(acc), 0, m, SPLIT, 1, BN, BM)  # the workspace holds [BN, BM] tiles
    if arrive_last(cnt_ptr, SPLIT):
        total = gather_partials(ws_ptr, 0, m, SPLIT, 1, BN, BM)
        out_cols = start + tl.arange(0, BN)
        tl.store(
            out_ptr + rows[None, :].to(tl.int64) * out_stride + out_cols[:, None],
            total.to(out_ptr.dtype.element_ty),
            mask=rows[None, :] < m,
        )


@triton.jit(do_not_specialize=["m"])
def _gate_up_silu_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    out_ptr,
    m,
    k_dim,
    x_stride,
    out_stride,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    gate = _gemv_tile(x_ptr, wg_ptr, m, k_dim, 0, k_dim, x_stride, rows, cols, BM, BN, BK, PRECISION)
    up = _gemv_tile(x_ptr, wu_ptr, m, k_dim, 0, k_dim, x_stride, rows, cols, BM, BN, BK, PRECISION)
    out = _swiglu(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], out, mask=rows[:, None] < m)


@triton.jit(do_not_specialize=["m"])
def _gate_up_silu_split_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    m,
    k_dim,
    k_per_split,
    x_stride,
    out_stride,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``_gate_up_silu_kernel`` with K cut into SPLIT slices (as ``_multi_linear_split_kernel``): the gate and up
    partials are two parts of the workspace; the last program sums each in slice order, then applies SwiGLU."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    x_ptr, out_ptr, m = row_block_ptrs(x_ptr, out_ptr, m, x_stride, out_stride, BM)
    k_lo, k_hi = k_slice_range(k_dim, k_per_split)
    rows = tl.arange(0, BM)
    gate = _gemv_tile(x_ptr, wg_ptr, m, k_dim, k_lo, k_hi, x_stride, rows, cols, BM, BN, BK, PRECISION)
    up = _gemv_tile(x_ptr, wu_ptr, m, k_dim, k_lo, k_hi, x_stride, rows, cols, BM, BN, BK, PRECISION)
    publish_partial(ws_ptr, tl.trans(gate), 0, m, SPLIT, 2, BN, BM)
    publish_partial(ws_ptr, tl.trans(up), 1, m, SPLIT, 2, BN, BM)
    if arrive_last(cnt_ptr, SPLIT):
        gate_sum = gather_partials(
            ws_ptr, 0, m, SPLIT, 2, BN, BM
        )  # [BN, BM]: new names (a branch keeps shapes)
        up_sum = gather_partials(ws_ptr, 1, m, SPLIT, 2, BN, BM)
        tl.store(
            out_ptr + rows[None, :].to(tl.int64) * out_stride + cols[:, None],
            _swiglu(gate_sum, up_sum, out_ptr.dtype.element_ty),
            mask=rows[None, :] < m,
        )


@triton.jit
def _swiglu(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` of fp32 sums, in ``dtype``: the projections are activations in the model dtype before
    the product, as in the eager layer."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)


def row_block(m: int) -> int:
    """The row tile (BM) for ``m`` rows: 16, 32 or 64 (see the module docstring on bit equality)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"decode GEMV takes 1..{MAX_ROWS} rows, got {m}")
    return 16 if m <= 16 else 32 if m <= 32 else 64


def fit_stages(bm: int, bn: int, bk: int, stages: int, weight_tiles: int, elem: int) -> int:
    """Cap the pipeline depth so the staged x and weight tiles fit Hopper's ~227 KB of shared memory
    (wider row tiles stage more of x per K step)."""
    per_stage = (bm + weight_tiles * bn) * bk * elem
    return max(1, min(stages, (200 * 1024) // per_stage))


def _tile(n_total: int, k_dim: int, bm: int = 16) -> tuple[int, int, int]:
    """(BN, BK, stages) for a ``bm``-row tile, from GPU sweeps (graph replays, weights out of L2;
    docs/benchmarks.md). 16 rows: 32-wide output tiles beat 16 on every 8B shape, narrow outputs keep 16 so
    the grid fills the SMs. 32 rows: (32, 256, 4) is best or within 2% everywhere. 64 rows: the 12288-long
    rows need 256-wide K steps, wide outputs a 64x128 tile.
    The tile does not change a row's bits: the K loop accumulates into one MMA accumulator in the same
    order whatever BN and BK are."""
    bn = 32 if n_total // 32 >= 128 else 16
    if bm == 16:
        return (bn, 512, 3) if k_dim >= 8192 else (bn, 256, 4)
    if bm == 64 and n_total >= 6144 and k_dim < 8192:
        return (64, 128, 4)
    return (bn, 256, 4)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _launch(
    kernels, split: int, tiles: int, x: torch.Tensor, operands: tuple, trailing: tuple, parts: int, **consts
):
    """Launch ``kernels[0]`` over (tiles, row blocks), or with ``split`` > 1 ``kernels[1]`` over (tiles, split, row
    blocks) with its workspace (``parts`` partials per program), counters and slice width. Arguments: the
    ``operands`` (pointers), the buffers of a split launch, the row count and K, the slice width, ``trailing``."""
    bm = consts["BM"]
    blocks = triton.cdiv(x.shape[0], bm)
    if split == 1:
        kernels[0][(tiles, blocks)](*operands, x.shape[0], x.shape[1], *trailing, **consts)
        return
    ws, cnt = gemv_split.split_buffers(split, tiles, blocks, consts["BN"], bm, x.device, parts)
    slice_k = gemv_split.slice_columns(x.shape[1], split)
    kernels[1][(tiles, split, blocks)](
        *operands, ws, cnt, x.shape[0], x.shape[1], slice_k, *trailing, SPLIT=split, **consts
    )


def multi_linear_plan(
    m: int,
    sizes: list[int],
    k_dim: int,
    elem: int,
    tile: tuple[int, int, int] | None = None,
    bm: int | None = None,
    sms: int | None = None,
    split: int | None = None,
) -> tuple[int, int, int, int, int]:
    """``(BM, BN, BK, stages, split)`` of ``multi_linear_triton``'s launch for ``m`` rows of ``elem``-byte
    activations against weights of ``sizes`` rows (also what ``tests/perf/sass_dense_gemv.py`` compiles)."""
    bm = bm or row_block(m)
    n_total = sum(sizes)
    if split is None:
        split = gemv_split.split_count(n_total, k_dim, sms)
    bn, bk, stages = _tile(n_total, k_dim, bm)
    if split > 1 and bk > gemv_split.SLICE_ALIGN:  # whole steps of a slice (SLICE_ALIGN columns each)
        bk, stages = gemv_split.SLICE_ALIGN, 4
    if tile is not None:
        bn, bk, stages = tile
    if any(n % bn for n in sizes):
        bn = 16
    return bm, bn, bk, fit_stages(bm, bn, bk, stages, 1, elem), split


def multi_linear_triton(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    tile: tuple[int, int, int] | None = None,
    bm: int | None = None,
    *,
    sms: int | None = None,
    split: int | None = None,
) -> list[torch.Tensor]:
    """``tile = (BN, BK, stages)`` overrides the default (tile sweeps on the GPU). ``bm`` pins the row tile for
    any row count (the grid then walks ``bm``-row blocks: ``dgpp.nn.exact.gemm``'s fixed-order calls). K is
    split by ``gemv_split.split_count`` for the SM count ``sms`` (default: the device's; none on the CPU);
    ``split`` forces a count (timing sweeps)."""
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"multi_linear takes 1 to 3 weights, got {len(weights)}")
    sizes = [w.shape[0] for w in weights]
    n_total = sum(sizes)
    k_dim = x.shape[1]
    bm, bn, bk, stages, split = multi_linear_plan(
        x.shape[0], sizes, k_dim, x.element_size(), tile, bm, sms or gemv_split.device_sms(x), split
    )
    out = torch.empty(x.shape[0], n_total, dtype=x.dtype, device=x.device)
    padded = list(weights) + [weights[0]] * (3 - len(weights))
    n0 = sizes[0]
    n1 = sizes[1] if len(sizes) > 1 else 0
    _launch(
        (_multi_linear_kernel, _multi_linear_split_kernel),
        split,
        n_total // bn,
        x,
        (x, *padded, out),
        (n0, n1, x.stride(0), out.stride(0)),
        parts=1,
        BM=bm,
        BN=bn,
        BK=bk,
        PRECISION=_precision(x),
        num_warps=4,
        num_stages=stages,
    )
    return list(out.split(sizes, dim=1))


def gate_up_silu_plan(
    m: int,
    inter: int,
    k_dim: int,
    elem: int,
    tile: tuple[int, int, int] | None = None,
    bm: int | None = None,
    sms: int | None = None,
    split: int | None = None,
) -> tuple[int, int, int, int, int]:
    """``(BM, BN, BK, stages, split)`` of ``gate_up_silu_triton``'s launch (as ``multi_linear_plan``); the split
    follows the intermediate width ``inter``."""
    bm = bm or row_block(m)
    if split is None:
        split = gemv_split.split_count(inter, k_dim, sms)
    # H200, 12288x4096 pairs: 4.23 TB/s at 1-16 rows with (32, 256, 3); (32, 128, 4) is as fast there and
    # best at 32 rows (51.8 us) and 64 rows (66.9 us against 72.3)
    bn, bk, stages = _tile(2 * inter, k_dim)[0], 128, 4
    if tile is not None:
        bn, bk, stages = tile
    if inter % bn:
        bn = 16
    return bm, bn, bk, fit_stages(bm, bn, bk, stages, 2, elem), split


def gate_up_silu_triton(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    tile: tuple[int, int, int] | None = None,
    bm: int | None = None,
    *,
    sms: int | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """``tile = (BN, BK, stages)`` overrides the default (tile sweeps on the GPU); ``bm``, ``sms`` and ``split`` as
    in multi_linear_triton."""
    inter = w_gate.shape[0]
    bm, bn, bk, stages, split = gate_up_silu_plan(
        x.shape[0], inter, x.shape[1], x.element_size(), tile, bm, sms or gemv_split.device_sms(x), split
    )
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    _launch(
        (_gate_up_silu_kernel, _gate_up_silu_split_kernel),
        split,
        inter // bn,
        x,
        (x, w_gate, w_up, out),
        (x.stride(0), out.stride(0)),
        parts=2,
        BM=bm,
        BN=bn,
        BK=bk,
        PRECISION=_precision(x),
        num_warps=4,
        num_stages=stages,
    )
    return out


def gemv_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """True when the decode kernels can take these operands (CUDA, <= 64 rows, plain dense weights)."""
    if not use_triton(x) or not current().dense_gemv:
        return False
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        return False
    return all(
        w.dim() == 2
        and w.dtype == x.dtype
        and w.shape[1] == x.shape[1]
        and w.shape[0] % 16 == 0
        and w.is_contiguous()
        for w in weights
    )


def multi_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]``: one Triton launch for decode rows, ``F.linear`` otherwise."""
    return multi_linear_triton(x, weights) if gemv_applies(x, *weights) else multi_linear_ref(x, weights)


def gate_up_silu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``silu(x wg^T) * (x wu^T)``: one Triton launch for decode rows, torch otherwise."""
    if gemv_applies(x, w_gate, w_up):
        return gate_up_silu_triton(x, w_gate, w_up)
    return gate_up_silu_ref(x, w_gate, w_up)


def lm_head_gemv(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The LM head's ``hidden @ weight.T`` through the decode GEMV, or None to leave it to cuBLAS.

    Opt-in (``DGPP_GEMV_HEAD=1``): cuBLAS already streams the 151936x4096 Qwen3 head at ~3.8 TB/s, so the
    GEMV takes it only where ``tests/perf/check_kernels.py`` (``lm head`` lines) measures a tile beating
    that. A vocab-parallel rank passes its own contiguous slice of rows."""
    if not current().gemv_head or not gemv_applies(hidden, weight):
        return None
    return multi_linear_triton(hidden, [weight])[0]
