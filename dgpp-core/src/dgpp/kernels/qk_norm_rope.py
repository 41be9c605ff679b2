"""Per-head q/k RMSNorm followed by rotary embedding, in one pass (Qwen3-style attention).

``q [T, Hq, D]``, ``k [T, Hk, D]``; ``q_weight, k_weight [D]``; rotary as in ``dgpp.kernels.rotary``
(``inv_freq [rotary_dim/2]``, ``magnitude``, neox or interleaved pairs). The result equals
``apply_rotary(rms_norm(q), rms_norm(k))`` of the separate kernels bit for bit: the normalised rows
are rounded to the activation dtype before they rotate, as the unfused layers do. One program per
(token, head) over the q heads then the k heads: decode pays one launch instead of three, and its
few tokens still spread over many SMs.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.rmsnorm import rms_norm_ref
from dgpp.kernels.rotary import rotary_cos_sin, rotary_pair_offsets, rotary_ref


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    magnitude: float = 1.0,
    is_neox: bool = True,
    fp32_product: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    qn = rms_norm_ref(q, q_weight, eps, None, weight_offset, fp32_product)
    kn = rms_norm_ref(k, k_weight, eps, None, weight_offset, fp32_product)
    return rotary_ref(qn, kn, positions, inv_freq, magnitude, is_neox)


@triton.jit
def _norm_rope_heads(
    src,
    dst,
    w_ptr,
    row,
    n_heads,
    s_tok,
    s_head,
    d_tok,
    d_head,
    head_dim,
    eps,
    weight_offset,
    cos,
    sin,
    half,
    FP32_PRODUCT: tl.constexpr,
    IS_NEOX: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    hmask = heads < n_heads
    i1, i2 = rotary_pair_offsets(half, IS_NEOX, ROT)
    tail = ROT + tl.arange(0, BLOCK_D)[None, :]
    tmask = hmask & (tail < head_dim)
    sbase = src + row * s_tok + heads * s_head
    x1 = tl.load(sbase + i1, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(sbase + i2, mask=hmask, other=0.0).to(tl.float32)
    x3 = tl.load(sbase + tail, mask=tmask, other=0.0).to(tl.float32)
    sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
    rstd = tl.rsqrt(sq / head_dim + eps)[:, None]
    w1 = tl.load(w_ptr + i1).to(tl.float32) + weight_offset
    w2 = tl.load(w_ptr + i2).to(tl.float32) + weight_offset
    w3 = tl.load(w_ptr + tail, mask=tail < head_dim, other=0.0).to(tl.float32) + weight_offset
    n1, n2, n3 = x1 * rstd, x2 * rstd, x3 * rstd
    out_ty = dst.dtype.element_ty
    if not FP32_PRODUCT:  # plain weights scale the row after it was rounded, as RMSNorm does
        n1 = n1.to(out_ty).to(tl.float32)
        n2 = n2.to(out_ty).to(tl.float32)
        n3 = n3.to(out_ty).to(tl.float32)
    # the norm's output is an activation in the model dtype: round before rotating
    n1 = (n1 * w1).to(out_ty).to(tl.float32)
    n2 = (n2 * w2).to(out_ty).to(tl.float32)
    dbase = dst + row * d_tok + heads * d_head
    tl.store(dbase + i1, (n1 * cos - n2 * sin).to(out_ty), mask=hmask)
    tl.store(dbase + i2, (n2 * cos + n1 * sin).to(out_ty), mask=hmask)
    if ROT < BLOCK_D:
        tl.store(dbase + tail, (n3 * w3).to(out_ty), mask=tmask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    freq_ptr,
    magnitude,
    eps,
    weight_offset,
    n_q_heads,
    head_dim,
    q_tok,
    q_head,
    k_tok,
    k_head,
    qo_tok,
    qo_head,
    ko_tok,
    ko_head,
    FP32_PRODUCT: tl.constexpr,
    IS_NEOX: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = tl.arange(0, ROT // 2)
    cos, sin = rotary_cos_sin(pos_ptr, freq_ptr, row, half, magnitude)
    # heads 0..Hq-1 are q's, the rest k's
    src, dst, w_ptr, s_tok, d_tok = q_ptr + head * q_head, qo_ptr + head * qo_head, qw_ptr, q_tok, qo_tok
    if head >= n_q_heads:
        kh = head - n_q_heads
        src, dst, w_ptr, s_tok, d_tok = k_ptr + kh * k_head, ko_ptr + kh * ko_head, kw_ptr, k_tok, ko_tok
    _norm_rope_heads(
        src,
        dst,
        w_ptr,
        row,
        1,
        s_tok,
        0,
        d_tok,
        0,
        head_dim,
        eps,
        weight_offset,
        cos,
        sin,
        half,
        FP32_PRODUCT,
        IS_NEOX,
        ROT,
        1,
        BLOCK_D,
    )


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    magnitude: float = 1.0,
    is_neox: bool = True,
    fp32_product: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = 2 * inv_freq.shape[0]
    if rotary_dim & (rotary_dim - 1):
        raise ValueError(f"qk_norm_rope_triton needs a power-of-two rotary_dim, got {rotary_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    tokens, hq, dim = q.shape
    q_out = torch.empty(tokens, hq, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, k.shape[1], dim, dtype=k.dtype, device=k.device)
    if tokens:
        _qk_norm_rope_kernel[(tokens, hq + k.shape[1])](
            q,
            k,
            q_out,
            k_out,
            q_weight,
            k_weight,
            positions,
            inv_freq.float().contiguous(),
            float(magnitude),
            float(eps),
            float(weight_offset),
            hq,
            dim,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            FP32_PRODUCT=weight_offset != 0.0 if fp32_product is None else fp32_product,
            IS_NEOX=is_neox,
            ROT=rotary_dim,
            BLOCK_D=next_pow2(dim),
            num_warps=1,
        )
    return q_out, k_out


def fused_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    magnitude: float = 1.0,
    is_neox: bool = True,
    fp32_product: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k RMSNorm then RoPE; one Triton launch on CUDA, torch elsewhere. ``fp32_product`` as in
    ``dgpp.kernels.rmsnorm``."""
    fn = qk_norm_rope_triton if use_triton(q) else qk_norm_rope_ref
    return fn(
        q, k, q_weight, k_weight, eps, weight_offset, positions, inv_freq, magnitude, is_neox, fp32_product
    )
