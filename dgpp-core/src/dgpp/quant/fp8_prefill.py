"""``engine.prefill_fp8_gemm`` (lossy, off by default): prefill rows of FP8 block-scaled linears as an e4m3 GEMM.

The exact chain decodes each E4M3 weight to the activation dtype (code x block scale, rounded) and multiplies
in that dtype. With the lever, as in the original engine (github.com/HawkBearPig/dgpp, its fp8 prefill GEMM), a
prefill row is quantized per token and per weight block along K (``1 x bk``, 128 for the releases' 128 x 128
blocks): scale = the group's largest |x| / 448, codes = e4m3(x / scale); then

    out[m, n] = sum over groups g of (sum_{k in g} a[m, k] * w[n, k]) * (sa[m, g] * sw[n / bn, g])

with every code product exact in fp32 and one fp32 partial per group, promoted by the two scales into one fp32
accumulator, rounded once to the activation dtype. The activation quantizer runs in torch on every device (its
division is IEEE on both, so the codes are the same bits); the GEMM is ``dgpp.quant.kernels.fp8_gemm`` on CUDA
(the fp8 tensor cores) and ``fp8_gemm_reference`` on the CPU (row-wise fp32 products of the decoded codes,
``dgpp.nn.batch_invariant``). Which rows take it is ``dgpp.step.prefill_rows``'s answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.policy import current
from dgpp.quant.format import QuantFormat, Shape, cdiv
from dgpp.quant.fp8 import FP8Block
from dgpp.step.prefill_rows import prefill_rows

E4M3_MAX = 448.0


def fp8_gemm_applies(fmt: QuantFormat) -> bool:
    """The lever is on and the weight is E4M3 with block (or per-channel) scales."""
    return current().prefill_fp8_gemm and isinstance(fmt, FP8Block)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 codes ``[M, K]``, fp32 scales ``[M, ceil(K / group)]``): per row and ``group``
    columns (the last group may be short), scale = largest |x| / 448 (1 for an all-zero group)."""
    m, k = x.shape
    groups = cdiv(k, group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(-1)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (padded / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, groups * group)[:, :k].contiguous(), scales


def weight_operands(
    fmt: FP8Block, tensors: dict[str, torch.Tensor], shape: Shape
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """(E4M3 weight ``[N, K]``, fp32 block scales ``[ceil(N / bn), ceil(K / bk)]``, the block ``(bn, bk)``)."""
    bn, bk = fmt.block_for(shape)
    scales = fmt.block_scales(tensors).reshape(cdiv(shape[0], bn), cdiv(shape[1], bk))
    return tensors["weight"].view(torch.float8_e4m3fn), scales, (bn, bk)


def fp8_gemm_reference(
    codes: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    w_scales: torch.Tensor,
    block: tuple[int, int],
) -> torch.Tensor:
    """The fp32 ``[M, N]`` result of the formula above: one row-wise fp32 product per K group (a row's bits do
    not depend on the rows beside it), each promoted by ``a_scales[m, g] * w_scales[n / bn, g]``."""
    bn, bk = block
    n, k = weight.shape
    out = torch.zeros(codes.shape[0], n, dtype=torch.float32, device=codes.device)
    for g in range(cdiv(k, bk)):
        lo, hi = g * bk, min(k, (g + 1) * bk)
        part = batch_invariant_linear(codes[:, lo:hi].float(), weight[:, lo:hi].float())
        col_scales = w_scales[:, g].repeat_interleave(bn)[:n]
        out += part * (a_scales[:, g, None] * col_scales[None, :])
    return out


def fp8_linear(
    fmt: FP8Block, tensors: dict[str, torch.Tensor], x: torch.Tensor, shape: Shape
) -> torch.Tensor:
    """``x [M, K] @ W^T`` through the fp8 GEMM for every row of ``x``, in ``x.dtype``."""
    weight, w_scales, block = weight_operands(fmt, tensors, shape)
    codes, a_scales = quantize_activations(x, block[1])
    if x.is_cuda:
        from dgpp.quant.kernels.fp8_gemm import fp8_gemm

        return fp8_gemm(codes, a_scales, weight, w_scales, block, x.dtype)
    return fp8_gemm_reference(codes, a_scales, weight, w_scales, block).to(x.dtype)


def fp8_prefill_matmul(
    fmt: QuantFormat,
    tensors: dict[str, torch.Tensor],
    x: torch.Tensor,
    shape: Shape,
    exact: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """``x @ W^T`` with the step's prefill rows through the fp8 GEMM, or None when the lever does not act here
    (off, another format, or no prefill row: the caller's exact path). ``exact(rows)`` computes rows the
    exact way (the canonical rows of a step that mixes them with prefill rows)."""
    if not fp8_gemm_applies(fmt):
        return None
    assert isinstance(fmt, FP8Block)
    x2 = x.reshape(-1, shape[1])
    rows = prefill_rows(x2)
    if rows is None:
        return None
    if isinstance(rows, str):
        out = fp8_linear(fmt, tensors, x2, shape)
    else:
        out = exact(x2)
        out[rows] = fp8_linear(fmt, tensors, x2.index_select(0, rows), shape)
    return out.reshape(*x.shape[:-1], shape[0])
