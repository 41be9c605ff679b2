"""``dst[index[i]] = src[i]`` for the rows ``i`` with ``keep[i]``, without a host sync (CUDA-graph safe).

A decode step of compressed attention (``dgpp.nn.compressed_decode``) completes a window on some rows only, and a
padded graph row must write nothing; which rows write is known on the device alone. Torch's boolean indexing
would sync to size its result, so the store is one Triton program per row, masked. The torch reference (off
CUDA) indexes with the mask.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton


def store_rows_ref(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, keep: torch.Tensor) -> None:
    """``dst [N, D]``, ``index [R]`` int64, ``src [R, D]``, ``keep [R]`` bool."""
    dst[index[keep]] = src[keep].to(dst.dtype)


@triton.jit
def _store_rows_kernel(dst_ptr, index_ptr, src_ptr, keep_ptr, dim, dst_row, src_row, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    keep = tl.load(keep_ptr + r) != 0
    row = tl.load(index_ptr + r).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    vals = tl.load(src_ptr + r * src_row + d, mask=d < dim)
    tl.store(dst_ptr + row * dst_row + d, vals.to(dst_ptr.dtype.element_ty), mask=keep & (d < dim))


def store_rows_triton(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, keep: torch.Tensor) -> None:
    rows, dim = src.shape
    if rows == 0:
        return
    src = src.contiguous()
    _store_rows_kernel[(rows,)](
        dst,
        index,
        src,
        keep.to(torch.int8),
        dim,
        dst.stride(0),
        src.stride(0),
        BLOCK_D=next_pow2(dim),
        num_warps=4,
    )


def store_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, keep: torch.Tensor) -> None:
    """Masked row scatter; Triton on CUDA, the torch reference elsewhere. ``dst`` must be row-contiguous."""
    (store_rows_triton if use_triton(dst) else store_rows_ref)(dst, index, src, keep)
