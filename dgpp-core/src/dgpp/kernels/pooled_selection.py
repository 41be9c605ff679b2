"""Pool picks to the token positions a query row attends (a k-pooled indexer's selection), one launch.

A row that sees ``n = seq_len`` tokens holds ``complete = n // kpool`` complete pools. With ``complete > keep`` it
is sparse: its ``keep`` picked pools (``pools [R, keep]``, ascending) expand to their ``kpool`` tokens each, then
(``tail``) the ``n % kpool`` visible tokens of the open pool. Otherwise it is dense: tokens ``0 .. n - 1``. Every
row fills ``keep·kpool + kpool - 1`` columns, zero past its ``count``; a padding row (``seq_len`` 0) counts
none. One program per row, reading nothing but its own picks and length (no host value: a CUDA graph captures it).
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton


@triton.jit
def _pooled_positions_kernel(
    pools_ptr,
    lens_ptr,
    out_ptr,
    count_ptr,
    sparse_ptr,
    keep,
    kpool,
    width,
    p_r,
    o_r,
    TAIL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + r).to(tl.int32)
    sparse = n // kpool > keep
    picked = keep * kpool
    count = tl.where(sparse, picked + (n % kpool if TAIL else 0), n)
    col = tl.arange(0, BLOCK)
    for c0 in range(0, width, BLOCK):
        c = c0 + col
        pool = tl.load(pools_ptr + r * p_r + c // kpool, mask=sparse & (c < picked), other=0)
        on_sparse = tl.where(c < picked, pool * kpool + c % kpool, n - n % kpool + (c - picked))
        pos = tl.where(c < count, tl.where(sparse, on_sparse, c), 0)
        tl.store(out_ptr + r * o_r + c, pos, mask=c < width)
    tl.store(count_ptr + r, count)
    tl.store(sparse_ptr + r, sparse.to(tl.int32))


def pooled_positions_triton(
    pools: torch.Tensor, seq_lens: torch.Tensor, kpool: int, tail: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions [R, keep·kpool + kpool - 1], count [R], sparse [R])``, int32, from ``pools [R, keep]``."""
    rows, keep = pools.shape
    width = keep * kpool + kpool - 1
    positions = torch.empty(rows, width, dtype=torch.int32, device=pools.device)
    count = torch.empty(rows, dtype=torch.int32, device=pools.device)
    sparse = torch.empty(rows, dtype=torch.int32, device=pools.device)
    if rows:
        _pooled_positions_kernel[(rows,)](
            pools,
            seq_lens,
            positions,
            count,
            sparse,
            keep,
            kpool,
            width,
            pools.stride(0),
            positions.stride(0),
            TAIL=tail,
            BLOCK=min(1024, next_pow2(width)),
            num_warps=4,
        )
    return positions, count, sparse
