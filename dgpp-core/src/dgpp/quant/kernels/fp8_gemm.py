"""The e4m3 x e4m3 GEMM of ``engine.prefill_fp8_gemm`` (``dgpp.quant.fp8_prefill`` holds the formula and the
torch reference): per-token activation codes and scales against E4M3 weights with block scales.

Each program owns a ``[BM, BN]`` output tile and walks the K groups in order: a group's codes go through the fp8
tensor cores (sm_89 and later; ``BK``-wide steps into one fp32 partial), then the partial is promoted by the
activation row's and the weight block's scales into the fp32 accumulator, so no weight is ever decoded to the
activation dtype. Under the interpreter (and before sm_89) the codes are widened to fp32, whose products are
exact, and multiplied in IEEE fp32. Every output element depends on its own row and column only.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton
from dgpp.quant.format import cdiv
from dgpp.quant.kernels.operands import interpreting


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_om,
    SBN: tl.constexpr,
    GROUP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < m, cols < n
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for g in range(0, tl.cdiv(k, GROUP)):
        part = tl.zeros([BM, BN], tl.float32)
        for kk in range(0, GROUP, BK):  # the group's K steps, in order, into one fp32 partial
            offs = g * GROUP + kk + ks
            k_ok = (offs < k) & (kk + ks < GROUP)
            a = tl.load(
                a_ptr + rows[:, None].to(tl.int64) * stride_am + offs[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0,
            ).to(tl.float8e4nv, bitcast=True)
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0,
            ).to(tl.float8e4nv, bitcast=True)
            if FP8_DOT:
                part += tl.dot(a, tl.trans(w))
            else:
                part += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        sa = tl.load(as_ptr + rows * stride_asm + g, mask=row_ok, other=0.0)
        sw = tl.load(ws_ptr + (cols // SBN) * stride_wsn + g, mask=col_ok, other=0.0)
        acc += part * (sa[:, None] * sw[None, :])
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _fp8_dot(device: torch.device) -> bool:
    return not interpreting() and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemm(
    codes: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    w_scales: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` from e4m3 ``codes [M, K]`` with fp32 ``a_scales [M, G]`` and the e4m3
    ``weight [N, K]`` with fp32 ``w_scales [ceil(N / bn), G]``, ``block = (bn, bk)``, ``G = ceil(K / bk)``."""
    m, k = codes.shape
    n = weight.shape[0]
    bn, bk = block
    out = torch.empty(m, n, dtype=out_dtype, device=codes.device)
    if m == 0:
        return out
    bk_step = min(64, max(32, triton.next_power_of_2(bk)))  # the fp8 MMA takes K steps of 32
    bm, bn_tile = (64, 64) if interpreting() else (128, 128)
    a = codes.contiguous().view(torch.uint8)  # uint8 so masked loads can fill zeros
    w = weight.contiguous().view(torch.uint8)
    a_scales, w_scales = a_scales.float().contiguous(), w_scales.float().contiguous()
    grid = (cdiv(m, bm), cdiv(n, bn_tile))
    _fp8_gemm_kernel[grid](
        a,
        a_scales,
        w,
        w_scales,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_scales.stride(0),
        w.stride(0),
        w_scales.stride(0),
        out.stride(0),
        SBN=bn,
        GROUP=bk,
        BM=bm,
        BN=bn_tile,
        BK=bk_step,
        FP8_DOT=_fp8_dot(codes.device),
        num_warps=4 if interpreting() else 8,
        num_stages=3,
    )
    return out
