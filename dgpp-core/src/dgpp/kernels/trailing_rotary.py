"""Interleaved RoPE of each head's trailing ``rotary_dim`` channels (``TrailingRotary``), one launch a call.

``x [T, heads, D]`` (last dim contiguous), ``positions [T]``: channel pairs ``(2i, 2i + 1)`` of ``x[..., nope:]``
(``nope = D - rotary_dim``) turn by ``positions · inv_freq[i]``, the first ``nope`` channels are copied, and the
result is a new ``[T, heads, D]`` tensor. The math is the torch chain's op for op: the angle an fp32 product,
``cos`` and ``sin`` of it (CUDA's ``cosf`` / ``sinf``, libdevice here) times ``magnitude`` and rounded to the
activation dtype unless ``fp32_angles``, ``sin`` negated for the inverse turn, then ``e·cos - o·sin`` and
``o·cos + e·sin`` as separate fp32 products and a sum (launched with fp contraction off, so no FMA), rounded once.
The torch chain launches ~18 ops a call (angles, casts, ``repeat_interleave``, ``stack``, ``cat``); DeepSeek-V4
rotates 3-4 times a layer.

``head_rms_eps`` given: each head is first scaled by its unweighted RMS, ``x · rsqrt(mean(x²) + eps)`` with the
factor rounded to the activation dtype and the product rounded again (DeepSeek-V4's per-head query norm, 7 torch
ops), in the same launch. The head's sum of squares is one fp32 reduction in the kernel's order, not torch's.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton
from dgpp.kernels.torch_fp32_math import NO_FMA, cos_sin

_BLOCK_N = 128  # nope channels copied per step


@triton.jit
def _trailing_rotary_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    freq_ptr,
    magnitude,
    rms_eps,
    heads,
    nope,
    half,
    x_t,
    x_h,
    o_t,
    o_h,
    INVERSE: tl.constexpr,
    ROUND_ANGLES: tl.constexpr,
    HEAD_RMS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    hmask = h < heads
    i = tl.arange(0, BLOCK_R)
    imask = i < half
    angle = tl.load(pos_ptr + row).to(tl.float32) * tl.load(freq_ptr + i, mask=imask, other=0.0)
    cos, sin = cos_sin(angle)
    cos, sin = cos * magnitude, sin * magnitude
    out_ty = out_ptr.dtype.element_ty
    if ROUND_ANGLES:
        cos, sin = cos.to(out_ty).to(tl.float32), sin.to(out_ty).to(tl.float32)
    if INVERSE:
        sin = -sin
    src = x_ptr + row * x_t + h[:, None] * x_h
    dst = out_ptr + row * o_t + h[:, None] * o_h
    even = nope + 2 * i[None, :]
    pmask = hmask[:, None] & imask[None, :]
    e = tl.load(src + even, mask=pmask, other=0.0).to(tl.float32)
    o = tl.load(src + even + 1, mask=pmask, other=0.0).to(tl.float32)
    if HEAD_RMS:  # the head's sum of squares first: a second pass over the nope channels applies it
        squares = tl.sum(e * e + o * o, axis=1)
        for c0 in range(0, nope, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)[None, :]
            v = tl.load(src + c, mask=hmask[:, None] & (c < nope), other=0.0).to(tl.float32)
            squares += tl.sum(v * v, axis=1)
        factor = tl.rsqrt(squares / (nope + 2 * half) + rms_eps).to(out_ty).to(tl.float32)[:, None]
        e = (e * factor).to(out_ty).to(tl.float32)
        o = (o * factor).to(out_ty).to(tl.float32)
    for c0 in range(0, nope, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)[None, :]
        cmask = hmask[:, None] & (c < nope)
        if HEAD_RMS:
            v = tl.load(src + c, mask=cmask, other=0.0).to(tl.float32)
            tl.store(dst + c, (v * factor).to(out_ty), mask=cmask)
        else:
            tl.store(dst + c, tl.load(src + c, mask=cmask), mask=cmask)
    tl.store(dst + even, (e * cos[None, :] - o * sin[None, :]).to(out_ty), mask=pmask)
    tl.store(dst + even + 1, (o * cos[None, :] + e * sin[None, :]).to(out_ty), mask=pmask)


def trailing_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    magnitude: float,
    *,
    fp32_angles: bool,
    inverse: bool = False,
    head_rms_eps: float | None = None,
) -> torch.Tensor:
    """``TrailingRotary.rotate`` in one launch: ``x [T, heads, D]`` turned in a new tensor, each head first
    scaled by its RMS when ``head_rms_eps`` is given."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, heads, D] with a contiguous last dim, got {list(x.shape)}")
    rows, heads, dim = x.shape
    half = inv_freq.shape[0]
    if 2 * half > dim or positions.shape != (rows,):
        raise ValueError(
            f"a {2 * half}-channel rotary of {list(x.shape)} needs at most {dim} channels and [{rows}] positions, "
            f"got positions {list(positions.shape)}"
        )
    positions = positions if positions.stride(0) == 1 else positions.contiguous()  # read as a flat row
    out = torch.empty(rows, heads, dim, dtype=x.dtype, device=x.device)
    block_heads = min(16, next_pow2(heads))
    if rows and heads:
        _trailing_rotary_kernel[(rows, triton.cdiv(heads, block_heads))](
            x,
            out,
            positions,
            inv_freq,
            float(magnitude),
            float(head_rms_eps or 0.0),
            heads,
            dim - 2 * half,
            half,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            INVERSE=inverse,
            ROUND_ANGLES=not fp32_angles,
            HEAD_RMS=head_rms_eps is not None,
            BLOCK_HEADS=block_heads,
            BLOCK_R=max(2, next_pow2(half)),
            BLOCK_N=_BLOCK_N,
            num_warps=4,
            **NO_FMA,
        )
    return out
