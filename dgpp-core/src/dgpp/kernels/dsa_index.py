"""DSA indexer scores and selection over the paged index-key cache, for every query row at once.

``scores[r, t] = Σ_h w[r, h] · relu(scale · q[r, h] · k_t)`` for the first ``lens[r]`` cached tokens of row
``r`` (its own block table), ``-inf`` past them up to the table's width; ``q [R, H, D]`` and the keys are read
in fp32 as the indexer computes them (e4m3 keys dequantized once to the compute dtype first), ``w [R, H]`` fp32. ``select_top_k`` keeps each row's ``k`` best
positions (exact ties to the lower position, ``-inf`` never before a real token), ascending, and how many
of them are real: a row with at most ``k`` tokens keeps them all, in order, which is the dense row.

The Triton kernel computes a (row, token) score from that row's query and that token's key alone, in one
fixed order (a 128-deep dot per head, then the head sum in a fixed tree), so a row's scores do not depend on
the rows beside it or the table's width: prefill chunks, decode steps and a speculative verify select alike.
One program scores a row's 64-token tile. Its dot runs in 32-deep slices chained through the accumulator: on
a GPU the same fma chain per (head, token) as one whole-depth dot, with a slice's operands held in registers
(the whole-depth operands spilled ~6.8 KB a thread on sm_90).
Shapes depend only on the table, so a decode step's selection can be captured in a CUDA graph. Keys held packed
(``packed``: FP4 nibbles and a block scale per ``entry_block`` values, ``uint8`` rows) are decoded in registers to
fp32, the values a torch decode of the rows gives.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.block_scaled_tiles import PackedKeyForms, packed_fp4_tile
from dgpp.kernels.kv_fp8 import dequantize_rows

_BLOCK_T = 64
# depth of one slice of the per-head dot (sm_90: 128 registers a thread, no spill, at 64 heads x 64 tokens)
_BLOCK_C = 32


def index_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    rows, bs = q.shape[0], k_cache.shape[1]
    width = tables.shape[1] * bs
    out = torch.full((rows, width), float("-inf"), dtype=torch.float32, device=q.device)
    for r, n in enumerate(lens.tolist()):
        tok = torch.arange(n, device=q.device)
        phys, off = tables[r, tok // bs].long(), tok % bs
        keys = k_cache[phys, off, 0]
        if k_scale is not None:  # e4m3 keys: code * row scale, rounded once to the compute dtype
            keys = dequantize_rows(keys, k_scale[phys, off, 0], q.dtype)
        keys = keys.float()
        out[r, :n] = torch.relu(q[r].float() @ keys.t() * scale).t() @ weights[r].float()
    return out


@triton.jit
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    k8_ptr,
    ksc_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    heads,
    dim,
    block_size,
    width,
    scale,
    w_scale,
    q_r,
    q_h,
    w_r,
    k_blk,
    k_tok,
    sc_blk,
    sc_tok,
    bt_r,
    o_r,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    PACKED: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    KEY_E8M0: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_T
    t = start + tl.arange(0, BLOCK_T)
    n = tl.load(lens_ptr + r)
    score = tl.full([BLOCK_T], float("-inf"), tl.float32)
    if (
        start < n
    ):  # a tile wholly past the row's tokens multiplies nothing (a decode graph's table spans the pool)
        h = tl.arange(0, BLOCK_H)
        tmask = t < n
        w = tl.load(w_ptr + r * w_r + h, mask=h < heads, other=0.0).to(tl.float32) * w_scale
        phys = tl.load(bt_ptr + r * bt_r + t // block_size, mask=tmask, other=0).to(tl.int64)
        off = (t % block_size).to(tl.int64)
        rows_at = phys * k_blk + off * k_tok
        if HAS_SCALES:
            k_sc = tl.load(ksc_ptr + phys * sc_blk + off * sc_tok, mask=tmask, other=0.0)
        # the 128-deep dot in BLOCK_C-deep slices chained through the accumulator: each (head, token) is the
        # same fma chain in the same order as one dot, and a slice's operands fit in registers (one whole-depth
        # dot spilled kilobytes a thread)
        dots = tl.zeros([BLOCK_H, BLOCK_T], tl.float32)
        for c0 in range(0, BLOCK_D, BLOCK_C):
            d = c0 + tl.arange(0, BLOCK_C)
            q = tl.load(
                q_ptr + r * q_r + h[:, None] * q_h + d[None, :],
                mask=(h[:, None] < heads) & (d[None, :] < dim),
                other=0.0,
            ).to(tl.float32)
            if PACKED:  # FP4 rows: decoded in registers, [BLOCK_T, BLOCK_C] turned to [BLOCK_C, BLOCK_T]
                kmask = tmask[:, None] & (d[None, :] < dim)
                k = tl.trans(
                    packed_fp4_tile(k_ptr, k8_ptr, rows_at, d, kmask, dim, tl.float32, KEY_BLOCK, KEY_E8M0)
                )
            else:
                k = tl.load(
                    k_ptr + rows_at[None, :] + d[:, None], mask=tmask[None, :] & (d[:, None] < dim), other=0.0
                )  # [BLOCK_C, BLOCK_T]
            if HAS_SCALES:  # e4m3 keys: code * row scale, rounded once to the compute dtype
                k = (k.to(tl.float32) * k_sc[None, :]).to(q_ptr.dtype.element_ty)
            dots = tl.dot(q, k.to(tl.float32), dots, input_precision="ieee")
        s = tl.maximum(dots * scale, 0.0)  # [BLOCK_H, BLOCK_T]
        score = tl.where(tmask, tl.sum(s * w[:, None], axis=0), float("-inf"))
    tl.store(out_ptr + r * o_r + t, score, mask=t < width)  # the grid overhangs


def index_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    packed: PackedKeyForms | None = None,
    *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """``packed``: the keys are FP4 rows of ``packed``'s entry form (``dim / 2 + dim / entry_block`` bytes).
    ``weights`` in any float dtype, read as fp32 and times ``weight_scale`` (an fp32 product, as
    ``weights.float() * weight_scale`` is) in the kernel."""
    rows, heads, dim = q.shape
    if packed is not None and (
        k_cache.dtype != torch.uint8 or k_cache.shape[-1] != dim // 2 + dim // packed.entry_block
    ):
        raise ValueError(
            f"packed index keys must be uint8 rows of {dim // 2 + dim // packed.entry_block} bytes for {dim} "
            f"values: got {k_cache.dtype} rows of {k_cache.shape[-1]}"
        )
    forms = packed or PackedKeyForms()
    bs = k_cache.shape[1]
    width = tables.shape[1] * bs
    out = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    if rows and width:
        weights = weights if weights.stride(-1) == 1 else weights.contiguous()
        _index_scores_kernel[(rows, triton.cdiv(width, _BLOCK_T))](
            q,
            weights,
            k_cache,
            k_cache.view(torch.float8_e4m3fn) if packed is not None else k_cache,
            k_cache if k_scale is None else k_scale,  # unread without scales
            tables,
            lens,
            out,
            heads,
            dim,
            bs,
            width,
            float(scale),
            float(weight_scale),
            q.stride(0),
            q.stride(1),
            weights.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            0 if k_scale is None else k_scale.stride(0),
            0 if k_scale is None else k_scale.stride(1),
            tables.stride(0),
            out.stride(0),
            BLOCK_T=_BLOCK_T,
            BLOCK_H=max(16, next_pow2(heads)),
            BLOCK_D=max(16, next_pow2(dim)),
            BLOCK_C=min(_BLOCK_C, max(16, next_pow2(dim))),
            HAS_SCALES=k_scale is not None,
            PACKED=packed is not None,
            KEY_BLOCK=forms.entry_block,
            KEY_E8M0=forms.entry_e8m0,
            num_warps=4,
        )
    return out


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[R, width]`` fp32 index scores (``-inf`` past each row's tokens); Triton on CUDA, torch elsewhere.
    ``k_scale``: the fp32 row scales of an e4m3 key cache (``engine.kv_dtype`` fp8 / fp4)."""
    fn = index_scores_triton if use_triton(q) else index_scores_ref
    return fn(q, weights, k_cache, tables, lens, scale, k_scale)


def select_top_k(scores: torch.Tensor, lens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [R, k] int32 ascending, count [R] int32)``: each row's ``k`` best scores among its first
    ``lens[r]`` positions (whatever lies past them, padding of a graph's pool-wide table included, is never
    picked before a real token), exact ties to the lower position, ``count = min(lens, k)`` real ones first.

    Linear in the width: the k-th best value of each row (``torch.topk``; values only, so its own tie order
    does not matter), then every position scoring above it and the lowest-positioned of those equal to it,
    placed in ascending order by their running count. A row with at most ``k`` tokens keeps them all (its
    threshold is ``-inf``: the real tokens, then the lowest padding positions, which ``count`` leaves out)."""
    rows, width = scores.shape
    k = min(k, width)
    pos = torch.arange(width, device=scores.device)
    valid = pos[None, :] < lens[:, None]
    masked = torch.where(valid, scores, float("-inf"))
    kth = torch.topk(masked, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    better = masked > kth
    ties = masked == kth
    room = k - better.sum(dim=1, keepdim=True, dtype=torch.int32)
    take = better | (ties & (torch.cumsum(ties, dim=1, dtype=torch.int32) <= room))
    taken_so_far = torch.cumsum(take, dim=1, dtype=torch.int32)
    # taken positions go to columns 0..k-1 in order, the others after them: a permutation (no duplicate index)
    slot = torch.where(take, taken_so_far - 1, k + pos[None, :] - taken_so_far).long()
    positions = torch.empty(rows, width, dtype=torch.int32, device=scores.device)
    positions.scatter_(1, slot, pos.to(torch.int32).expand(rows, width))
    return positions[:, :k].contiguous(), torch.clamp(lens, max=k).to(torch.int32)
