"""x in the order a packed kernel's K steps read it, written once per launch so each read is one contiguous load.

A 32-bit word (or a byte, for E2M1) holds ``PW`` weights of consecutive K columns, and the kernels decode one
position of every word of a step at a time: position ``i`` of the step's words pairs with x's columns
``PW·j + i``. ``x_by_position`` writes each ``BK``-column step of x as its position-0 columns, then its
position-1 columns, and so on, so a kernel loads each position's x as a contiguous ``[rows, BK/PW]`` tile
instead of gathering columns ``PW`` apart. ``x_halves`` is the E2M1 case (``PW = 2``: each step's even columns,
then its odd ones) for the packed FP4 MMA GEMV; the row-exact int GEMM takes ``PW = 32 / bits``. The values are
x's own (a copy), so the dots and their order, and so the bits, are those of the gathered loads.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton
from dgpp.quant.format import cdiv


@triton.jit
def x_by_position_kernel(x_ptr, out_ptr, k_dim, x_stride, out_stride, BK: tl.constexpr, PW: tl.constexpr):
    """Row ``program_id(0)``, step ``program_id(1)``: position p of the step holds column PW (p mod BK/PW) +
    p div BK/PW of it; columns past ``k_dim`` are zeros (the kernels then read whole steps without a K mask)."""
    SUB: tl.constexpr = BK // PW
    row = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    pos = tl.arange(0, BK)
    col = k0 + PW * (pos % SUB) + pos // SUB
    vals = tl.load(x_ptr + row * x_stride + col, mask=col < k_dim, other=0.0)
    tl.store(out_ptr + row * out_stride + k0 + pos, vals)


def x_by_position(x: torch.Tensor, bk: int, per_word: int) -> torch.Tensor:
    """``x`` [m, K] as [m, K rounded up to ``bk``] in step order (per ``bk`` columns: the columns of word
    position 0, then position 1, ...). One launch, no host sync; the buffer comes from the caching allocator
    (CUDA-graph capture safe)."""
    m, k = x.shape
    steps = cdiv(k, bk)
    out = torch.empty(m, steps * bk, dtype=x.dtype, device=x.device)
    if m:
        x_by_position_kernel[(m, steps)](
            x, out, k, x.stride(0), out.stride(0), BK=bk, PW=per_word, num_warps=2
        )
    return out


def x_halves(x: torch.Tensor, bk: int) -> torch.Tensor:
    """``x`` [m, K] in E2M1 step order: per ``bk`` columns, the even ones, then the odd ones."""
    return x_by_position(x, bk, 2)
