"""Rotary position embedding on query and key rows.

``q [T, Hq, D]``, ``k [T, Hk, D]``, ``positions [T]``, ``inv_freq [rotary_dim / 2]`` (fp32, YaRN or
plain), ``magnitude`` scales cos and sin (YaRN attention factor). The angles are computed in the
kernel (``pos * inv_freq`` in fp32, as the torch layer does), so there is no cos/sin table to size
or index. The first ``rotary_dim`` channels of each head rotate (partial rotary leaves the rest). ``is_neox=True`` pairs channel ``i`` with
``i + rotary_dim/2`` (HF ``rotate_half``); ``False`` pairs neighbours ``2i, 2i+1`` (GPT-J / GLM style).
Both paths return new tensors; the inputs are not modified.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton

# query heads per program: a decode row of many wide heads (MLA's 64 x 256) spreads over several programs instead
# of one program copying the whole row
_HEADS_PER_PROGRAM = 8


def _rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool
) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        out = torch.cat([o1, o2], dim=-1)
    else:
        out = torch.stack([o1, o2], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    magnitude: float = 1.0,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = 2 * inv_freq.shape[0]
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    cos, sin = (angles.cos() * magnitude)[:, None, :], (angles.sin() * magnitude)[:, None, :]
    return _rotate_ref(q, cos, sin, rotary_dim, is_neox), _rotate_ref(k, cos, sin, rotary_dim, is_neox)


@triton.jit
def rotary_pair_offsets(half_offs, IS_NEOX: tl.constexpr, ROT: tl.constexpr):
    """The two channels each rotary pair ``half_offs`` rotates, as ``[1, ROT/2]`` offsets: ``i, i + ROT/2``
    (neox) or ``2i, 2i + 1`` (interleaved). Shared with the fused norm+RoPE kernel so both pair alike."""
    if IS_NEOX:
        i1 = half_offs[None, :]
        i2 = i1 + ROT // 2
    else:
        i1 = 2 * half_offs[None, :]
        i2 = i1 + 1
    return i1, i2


@triton.jit
def rotary_cos_sin(pos_ptr, freq_ptr, row, half_offs, magnitude):
    """``cos`` and ``sin`` of ``positions[row] * inv_freq`` scaled by ``magnitude``, as ``[1, ROT/2]`` fp32 rows.

    Computed the same way in the fused norm+RoPE kernel, so fused and separate paths agree bit for bit."""
    angle = tl.load(pos_ptr + row).to(tl.float32) * tl.load(freq_ptr + half_offs)
    return (tl.cos(angle) * magnitude)[None, :], (tl.sin(angle) * magnitude)[None, :]


@triton.jit
def _rotate_heads(
    src,
    dst,
    row,
    n_heads,
    s_tok,
    s_head,
    d_tok,
    d_head,
    head_dim,
    cos,
    sin,
    half_offs,
    IS_NEOX: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    hmask = heads < n_heads
    i1, i2 = rotary_pair_offsets(half_offs, IS_NEOX, ROT)
    sbase = src + row * s_tok + heads * s_head
    dbase = dst + row * d_tok + heads * d_head
    x1 = tl.load(sbase + i1, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(sbase + i2, mask=hmask, other=0.0).to(tl.float32)
    tl.store(dbase + i1, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=hmask)
    tl.store(dbase + i2, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=hmask)
    if ROT < BLOCK_D:  # partial rotary: the channels past rotary_dim are copied unchanged
        tail = ROT + tl.arange(0, BLOCK_D)[None, :]
        tmask = hmask & (tail < head_dim)
        tl.store(dbase + tail, tl.load(sbase + tail, mask=tmask), mask=tmask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    freq_ptr,
    magnitude,
    n_q_heads,
    n_k_heads,
    head_dim,
    q_tok,
    q_head,
    k_tok,
    k_head,
    qo_tok,
    qo_head,
    ko_tok,
    ko_head,
    IS_NEOX: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_HQ  # this program's block of query heads; the first block also rotates k
    half = tl.arange(0, ROT // 2)
    cos, sin = rotary_cos_sin(pos_ptr, freq_ptr, row, half, magnitude)
    _rotate_heads(
        q_ptr + first * q_head,
        qo_ptr + first * qo_head,
        row,
        n_q_heads - first,
        q_tok,
        q_head,
        qo_tok,
        qo_head,
        head_dim,
        cos,
        sin,
        half,
        IS_NEOX,
        ROT,
        BLOCK_HQ,
        BLOCK_D,
    )
    _rotate_heads(
        k_ptr,
        ko_ptr,
        row,
        tl.where(first == 0, n_k_heads, 0),
        k_tok,
        k_head,
        ko_tok,
        ko_head,
        head_dim,
        cos,
        sin,
        half,
        IS_NEOX,
        ROT,
        BLOCK_HK,
        BLOCK_D,
    )


def rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    magnitude: float = 1.0,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = 2 * inv_freq.shape[0]
    if not rotary_dim:  # nothing rotated (NoPE MLA: GLM-5.3-Flash's rope part is empty)
        return q, k
    if rotary_dim % 2 or rotary_dim & (rotary_dim - 1):
        raise ValueError(f"rotary_triton needs a power-of-two rotary_dim, got {rotary_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    tokens, hq, dim = q.shape
    if tokens:
        block_hq = min(next_pow2(hq), _HEADS_PER_PROGRAM)
        _rotary_kernel[(tokens, triton.cdiv(hq, block_hq))](
            q,
            k,
            q_out,
            k_out,
            positions,
            inv_freq.float().contiguous(),
            float(magnitude),
            hq,
            k.shape[1],
            dim,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            IS_NEOX=is_neox,
            ROT=rotary_dim,
            BLOCK_HQ=block_hq,
            BLOCK_HK=next_pow2(k.shape[1]),
            BLOCK_D=next_pow2(dim),
            num_warps=4,
        )
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    magnitude: float = 1.0,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at ``positions``; Triton on CUDA, torch elsewhere."""
    fn = rotary_triton if use_triton(q) else rotary_ref
    return fn(q, k, positions, inv_freq, magnitude, is_neox)
