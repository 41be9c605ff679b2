"""Per-head products ``out[r, h] = x[r, h] · w[h]``: MLA's weight absorption on the GPU.

``x [R, H, K]``, ``w [H, K, N]`` (any strides: ``W_uv`` is read transposed in place) -> ``[R, H, N]`` in x's
dtype, fp32 accumulation. MLA folds ``kv_b_proj``'s K half into the queries (``q_nope · W_uk``, K = nope,
N = latent) and its V half into the output (``o_lat · W_uvᵀ``, K = latent, N = v).

The Triton kernel keeps a row's bits independent of the rows beside it: the row tile is fixed (``BM``
rows, masked past the end), and every output element is one chain of ``BK``-wide MMA steps in ascending
K whatever the row count, so decode (one row per request), a speculative verify and a prefill chunk give a
position the same result. (cuBLAS picks its kernel by row count, which would not.)
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton, use_triton

_BM, _BN, _BK = 16, 64, 64


def head_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("rhk,hkn->rhn", x.float(), w.float()).to(x.dtype)


@triton.jit
def _head_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows,
    k_dim,
    n_dim,
    x_r,
    x_h,
    w_h,
    w_k,
    w_n,
    o_r,
    o_h,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    h = tl.program_id(1).to(tl.int64)
    n = tl.program_id(2) * BN + tl.arange(0, BN)
    rmask, nmask = r < rows, n < n_dim
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, k_dim, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < k_dim
        x = tl.load(
            x_ptr + r[:, None].to(tl.int64) * x_r + h * x_h + k[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + h * w_h + k[:, None] * w_k + n[None, :] * w_n,
            mask=kmask[:, None] & nmask[None, :],
            other=0.0,
        )
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.store(
        out_ptr + r[:, None].to(tl.int64) * o_r + h * o_h + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & nmask[None, :],
    )


def head_matmul_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    rows, heads, k_dim = x.shape
    n_dim = w.shape[2]
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty(rows, heads, n_dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _head_matmul_kernel[(triton.cdiv(rows, _BM), heads, triton.cdiv(n_dim, _BN))](
        x,
        w,
        out,
        rows,
        k_dim,
        n_dim,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        BM=_BM,
        BN=_BN,
        BK=_BK,
        PRECISION=precision,
        num_warps=4,
    )
    return out


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out[r, h] = x[r, h] · w[h]``; Triton on CUDA, the torch reference elsewhere."""
    return head_matmul_triton(x, w) if use_triton(x) else head_matmul_ref(x, w)
