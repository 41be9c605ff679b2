"""x for the packed FP4 MMA GEMV in the order its K steps read it: each ``BK``-column step's even columns, then
its odd ones. A byte of E2M1 holds columns 2j and 2j + 1, so a step's decoded weights are an even-column tile
and an odd-column tile, each dotted with x's columns of that parity. Written once per launch by this pre-pass,
the tiles load both halves as contiguous ``[rows, BK/2]`` tiles instead of every warp taking each step's x
apart in registers. The values are x's own (a copy), so the dots and their order, and so the bits, are those
of the per-step split."""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton
from dgpp.quant.format import cdiv


@triton.jit
def x_halves_kernel(x_ptr, out_ptr, k_dim, x_stride, out_stride, BK: tl.constexpr):
    """Row ``program_id(0)``, step ``program_id(1)``: position p of the step holds column 2 (p mod BK/2) + p div
    BK/2 of it; columns past ``k_dim`` are zeros (the tiles then read whole steps without a K mask)."""
    HALF: tl.constexpr = BK // 2
    row = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    pos = tl.arange(0, BK)
    col = k0 + 2 * (pos % HALF) + pos // HALF
    vals = tl.load(x_ptr + row * x_stride + col, mask=col < k_dim, other=0.0)
    tl.store(out_ptr + row * out_stride + k0 + pos, vals)


def x_halves(x: torch.Tensor, bk: int) -> torch.Tensor:
    """``x`` [m, K] as [m, K rounded up to ``bk``] in step order (even columns, then odd, per ``bk`` columns).
    One launch, no host sync; the buffer comes from the caching allocator (CUDA-graph capture safe)."""
    m, k = x.shape
    steps = cdiv(k, bk)
    out = torch.empty(m, steps * bk, dtype=x.dtype, device=x.device)
    if m:
        x_halves_kernel[(m, steps)](x, out, k, x.stride(0), out.stride(0), BK=bk, num_warps=2)
    return out
