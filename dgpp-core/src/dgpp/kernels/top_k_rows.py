"""Each row's ``k`` best scores among its first ``lens[r]``, read only up to ``lens[r]`` (not the table's width).

The result is ``select_top_k``'s (``dgpp.kernels.dsa_index``): ``positions [R, k]`` int32 ascending (exact ties to
the lower position) and ``count = min(lens, k)``; a row with at most ``k`` positions keeps them all, then the
lowest padding positions. ``select_top_k`` sorts out a row over the whole width (a CUDA graph's table spans the
pool, so a decode step pays for the widest context on every row); here one program per row finds the ``k``-th
best value by a radix select over its own scores (four passes of a 256-bin histogram of one byte of an
order-preserving integer key), then writes, in one pass in position order, every position scoring above it and
the lowest-positioned of those equal to it. Its reads grow with the row's length alone; nothing reads a host
value, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton

_BLOCK = 1024  # scores per step of a pass


@triton.jit
def _order_key(x):
    """An unsigned key ordered as the fp32 values are (``-inf`` lowest)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 ties with 0.0, as the values compare
    flipped = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative values: larger magnitude, smaller key
    return (flipped ^ -2147483648).to(tl.uint32, bitcast=True)  # then the sign bit: unsigned order


@triton.jit
def _top_k_rows_kernel(scores_ptr, lens_ptr, out_ptr, count_ptr, k, s_r, o_r, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + r).to(tl.int32)
    tl.store(count_ptr + r, tl.minimum(n, k))  # the count too: no clamp and cast launched after
    offs = tl.arange(0, BLOCK)
    if n <= k:  # every real position, then the lowest padding ones
        for c0 in range(0, k, BLOCK):
            i = c0 + offs
            tl.store(out_ptr + r * o_r + i, i, mask=i < k)
    else:
        # the k-th best key, a byte at a time from the top: `prefix` holds the bytes found, `need` how many
        # of the keys matching them still rank at or above the k-th
        prefix = tl.zeros([], tl.uint32)
        need = k
        bins = tl.arange(0, 256)
        for step in tl.static_range(4):
            shift = 24 - 8 * step
            hist = tl.zeros([256], tl.int32)
            for c0 in range(0, n, BLOCK):
                i = c0 + offs
                key = _order_key(tl.load(scores_ptr + r * s_r + i, mask=i < n, other=0.0))
                match = (i < n) & (((key >> shift) >> 8) == ((prefix >> shift) >> 8))  # the bytes found
                hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
            at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys in bins >= b
            digit = tl.max(tl.where(at_or_above >= need, bins, 0), axis=0)
            need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
            prefix = prefix | (digit.to(tl.uint32) << shift)
        taken = 0
        ties = 0
        for c0 in range(0, n, BLOCK):
            i = c0 + offs
            key = _order_key(tl.load(scores_ptr + r * s_r + i, mask=i < n, other=0.0))
            tie = (i < n) & (key == prefix)
            tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            take = (i < n) & ((key > prefix) | (tie & (tie_rank < need)))
            slot = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(out_ptr + r * o_r + slot, i, mask=take)
            taken += tl.sum(take.to(tl.int32), axis=0)
            ties += tl.sum(tie.to(tl.int32), axis=0)


def top_k_rows_triton(scores: torch.Tensor, lens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [R, k] int32 ascending, count [R] int32)`` of fp32 ``scores [R, width]``, as ``select_top_k``."""
    rows, width = scores.shape
    k = min(k, width)
    positions = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    if not (rows and k):
        return positions, torch.clamp(lens, max=k).to(torch.int32)
    count = torch.empty(rows, dtype=torch.int32, device=scores.device)
    scores = scores.float()
    _top_k_rows_kernel[(rows,)](
        scores, lens, positions, count, k, scores.stride(0), positions.stride(0), BLOCK=_BLOCK, num_warps=4
    )
    return positions, count
