"""MLA attention in the weight-absorbed form over the paged latent cache, dense or over selected tokens.

Per query row ``r`` and head ``h``: ``q_lat [R, H, L]`` (``q_nope · W_uk``, already absorbed) and the
rotated ``q_rot [R, H, P]`` score every key token ``t`` it attends to as
``scale · (q_lat · latent_t + q_rot · k_rot_t)``; the output is ``Σ_t softmax_t · latent_t`` ``[R, H, L]``
(the caller applies ``W_uv``). Caches: ``latent [blocks, block_size, 1, L]``, ``k_rot [.., 1, P]``.
``tables [R, max_blocks]`` is each row's own block table and ``lens [R]`` how many tokens it attends:
the first ``lens[r]`` positions (dense), or with ``indices [R, K]`` the positions ``indices[r, :lens[r]]``
(a DSA selection, any order); ``sparse [R]`` (int) says which rows read ``indices``. A row with ``lens`` 0
is a padding row and gets zeros. A quantized latent cache (``engine.kv_dtype`` fp8: e4m3 codes; fp4: packed
rows, ``dgpp.kernels.latent_formats``) comes with its fp32 row scales ``latent_scale [blocks, block_size, 1, 1]``;
each loaded tile is dequantized once, in fp32, to the compute dtype.

The Triton path reads each latent row once per program for both products (K and V are the same bytes):
one program per (row, block of ``BLOCK_H`` heads, split) runs an online softmax over its share of the
row's tokens, and a second kernel merges the splits. How a row's tokens are cut depends only on its own
``lens`` and the fixed split count (a ``BLOCK_N``-token multiple per split), so a row's bits do not depend
on the other rows of the call: decode, a speculative verify and a prefill chunk compute a position alike.
Nothing here reads a host value per step, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.block_scaled_tiles import e2m1_value
from dgpp.kernels.latent_formats import dequantize_latent, latent_format_of
from dgpp.kernels.online_softmax import finish_split, merge_splits, softmax_step
from dgpp.step.cache_spec import KV_FP8

MLA_SPLITS = 8  # fixed per row: its cut never depends on the batch
_BLOCK_N = 32  # tokens per inner step (a 32 x 512 latent tile)
_BLOCK_H = 16  # heads per program: they share every latent byte it loads


def mla_attention_ref(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
    sparse: torch.Tensor | None = None,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 torch reference, row by row; returns ``[R, H, L]`` in ``q_lat``'s dtype."""
    rows, heads, latent_dim = q_lat.shape
    bs = latent_cache.shape[1]
    out = torch.zeros(rows, heads, latent_dim, dtype=q_lat.dtype, device=q_lat.device)
    for r, n in enumerate(lens.tolist()):
        if n <= 0:
            continue
        picked = sparse is not None and bool(sparse[r])
        tok = indices[r, :n].long() if picked else torch.arange(n, device=q_lat.device)
        phys = tables[r, tok // bs].long()
        lat = latent_cache[phys, tok % bs, 0]
        if latent_scale is not None:
            lat = dequantize_latent(lat, latent_scale[phys, tok % bs, 0], latent_dim, q_lat.dtype)
        lat = lat.float()
        rope = rope_cache[phys, tok % bs, 0].float()
        scores = (q_lat[r].float() @ lat.t() + q_rot[r].float() @ rope.t()) * scale
        out[r] = (scores.softmax(-1) @ lat).to(q_lat.dtype)
    return out


@triton.jit
def _row_split(n, num_splits, BLOCK_N: tl.constexpr):
    """(tokens per split, splits used) of a row attending ``n`` tokens."""
    per_split = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    return per_split, tl.cdiv(n, tl.maximum(per_split, 1))


@triton.jit
def _latent_tile(
    lat_ptr,
    lat8_ptr,
    lsc_ptr,
    rows,
    scale_rows,
    cols,
    row_mask,
    col_mask,
    latent_dim,
    dtype: tl.constexpr,
    LATENT_FORMAT: tl.constexpr,
):
    """A ``[BLOCK_N, BLOCK_L]`` latent tile in the compute dtype from the pool's ``rows`` (element offsets of each
    token's row): as stored (format 0), or dequantized once in fp32 from e4m3 codes (1) or packed fp4 (2) and the
    row scales at ``scale_rows``, as ``dgpp.kernels.latent_formats`` reads them."""
    mask = row_mask[:, None] & col_mask[None, :]
    if LATENT_FORMAT == 0:
        tile = tl.load(lat_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)
    else:
        row_scale = tl.load(lsc_ptr + scale_rows, mask=row_mask, other=0.0)[:, None]
        if LATENT_FORMAT == 1:  # e4m3 codes: code * row scale
            codes = tl.load(lat8_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)
            tile = (codes.to(tl.float32) * row_scale).to(dtype)
        else:  # fp4: e2m1 nibble (low = even element) * (e4m3 block scale * row scale)
            packed = tl.load(lat_ptr + rows[:, None] + (cols // 2)[None, :], mask=mask, other=0).to(tl.int32)
            code = tl.where((cols % 2)[None, :] == 1, packed >> 4, packed & 15)
            block = tl.load(
                lat8_ptr + rows[:, None] + (latent_dim // 2 + cols // 16)[None, :], mask=mask, other=0.0
            )
            tile = (e2m1_value(code) * (block.to(tl.float32) * row_scale)).to(dtype)
    return tile


@triton.jit
def _mla_split_kernel(
    q_ptr,
    qr_ptr,
    lat_ptr,
    lat8_ptr,
    lsc_ptr,
    rope_ptr,
    bt_ptr,
    lens_ptr,
    idx_ptr,
    sparse_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale,
    heads,
    latent_dim,
    rope_dim,
    block_size,
    num_splits,
    q_r,
    q_h,
    qr_r,
    qr_h,
    lat_blk,
    lat_tok,
    lsc_blk,
    lsc_tok,
    rope_blk,
    rope_tok,
    bt_r,
    idx_r,
    o_r,
    o_h,
    HAS_IDX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PRECISION: tl.constexpr,
    LATENT_FORMAT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    n = tl.load(lens_ptr + r)
    per_split, used = _row_split(n, num_splits, BLOCK_N)
    hmask = h < heads
    cols = tl.arange(0, BLOCK_L)
    pcols = tl.arange(0, BLOCK_P)
    lmask = cols < latent_dim
    pmask = pcols < rope_dim
    if split < tl.maximum(used, 1):  # a padding row (n 0) still runs split 0, which writes its zeros
        q = tl.load(
            q_ptr + r * q_r + h[:, None] * q_h + cols[None, :],
            mask=hmask[:, None] & lmask[None, :],
            other=0.0,
        )
        qr = tl.load(
            qr_ptr + r * qr_r + h[:, None] * qr_h + pcols[None, :],
            mask=hmask[:, None] & pmask[None, :],
            other=0.0,
        )
        picked = False
        if HAS_IDX:
            picked = tl.load(sparse_ptr + r) != 0
        start = split * per_split
        end = tl.minimum(n, start + per_split)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            jmask = j < end
            tok = j
            if HAS_IDX:
                chosen = tl.load(idx_ptr + r * idx_r + j, mask=jmask & picked, other=0)
                tok = tl.where(picked, chosen, j)
            phys = tl.load(bt_ptr + r * bt_r + tok // block_size, mask=jmask, other=0).to(tl.int64)
            off = (tok % block_size).to(tl.int64)
            lat = _latent_tile(
                lat_ptr,
                lat8_ptr,
                lsc_ptr,
                phys * lat_blk + off * lat_tok,
                phys * lsc_blk + off * lsc_tok,
                cols,
                jmask,
                lmask,
                latent_dim,
                q_ptr.dtype.element_ty,
                LATENT_FORMAT,
            )  # [BLOCK_N, BLOCK_L], in the compute dtype
            rope = tl.load(
                rope_ptr + (phys * rope_blk + off * rope_tok)[None, :] + pcols[:, None],
                mask=jmask[None, :] & pmask[:, None],
                other=0.0,
            )  # [BLOCK_P, BLOCK_N]
            s = tl.dot(q, tl.trans(lat), input_precision=PRECISION)
            s = (s + tl.dot(qr, rope, input_precision=PRECISION)) * scale
            s = tl.where(jmask[None, :], s, float("-inf"))
            acc, m_i, l_i = softmax_step(s, lat, acc, m_i, l_i, PRECISION)
        out_ptrs = out_ptr + r * o_r + h[:, None] * o_h + cols[None, :]
        row = (r * heads + h) * num_splits + split
        omask = hmask[:, None] & lmask[None, :]
        finish_split(out_ptrs, part_acc_ptr, part_ml_ptr, row, acc, m_i, l_i, used, omask, hmask, BLOCK_L)


@triton.jit
def _mla_merge_kernel(
    part_acc_ptr,
    part_ml_ptr,
    lens_ptr,
    out_ptr,
    heads,
    latent_dim,
    num_splits,
    o_r,
    o_h,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + r)
    _per_split, used = _row_split(n, num_splits, BLOCK_N)
    if used > 1:  # a one-split row was written by split 0 itself
        first = (r * heads + h) * num_splits
        merge_splits(
            part_acc_ptr, part_ml_ptr, out_ptr + r * o_r + h * o_h, first, used, latent_dim, BLOCK_S, BLOCK_L
        )


def mla_attention_triton(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
    sparse: torch.Tensor | None = None,
    latent_scale: torch.Tensor | None = None,
    splits: int = MLA_SPLITS,
) -> torch.Tensor:
    rows, heads, latent_dim = q_lat.shape
    rope_dim = q_rot.shape[-1]
    out = torch.empty_like(q_lat)
    if rows == 0:
        return out
    block_l, block_h = next_pow2(latent_dim), min(_BLOCK_H, max(16, next_pow2(heads)))
    part_acc = torch.empty(rows, heads, splits, block_l, dtype=torch.float32, device=q_lat.device)
    part_ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q_lat.device)
    has_idx = indices is not None
    if not has_idx:
        indices = sparse = lens  # never read
    assert sparse is not None
    precision = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    latent_format = {"compute": 0, "fp8": 1, "fp4": 2}[latent_format_of(latent_cache)]
    # the pool's bytes also viewed as e4m3 (fp8 codes, fp4 block scales), and the row scales (unread in format 0)
    latent_e4m3 = latent_cache if latent_format == 0 else latent_cache.view(KV_FP8)
    row_scales = latent_scale if latent_scale is not None else lens
    _mla_split_kernel[(rows, triton.cdiv(heads, block_h), splits)](
        q_lat,
        q_rot,
        latent_cache,
        latent_e4m3,
        row_scales,
        rope_cache,
        tables,
        lens,
        indices,
        sparse,
        out,
        part_acc,
        part_ml,
        float(scale),
        heads,
        latent_dim,
        rope_dim,
        latent_cache.shape[1],
        splits,
        q_lat.stride(0),
        q_lat.stride(1),
        q_rot.stride(0),
        q_rot.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        row_scales.stride(0) if latent_scale is not None else 0,
        row_scales.stride(1) if latent_scale is not None else 0,
        rope_cache.stride(0),
        rope_cache.stride(1),
        tables.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        HAS_IDX=has_idx,
        BLOCK_N=_BLOCK_N,
        BLOCK_H=block_h,
        BLOCK_L=block_l,
        BLOCK_P=max(16, next_pow2(rope_dim)),
        PRECISION=precision,
        LATENT_FORMAT=latent_format,
        num_warps=4,
    )
    if splits > 1:
        _mla_merge_kernel[(rows, heads)](
            part_acc,
            part_ml,
            lens,
            out,
            heads,
            latent_dim,
            splits,
            out.stride(0),
            out.stride(1),
            BLOCK_N=_BLOCK_N,
            BLOCK_S=max(2, next_pow2(splits)),
            BLOCK_L=block_l,
            num_warps=4,
        )
    return out


def mla_attention(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
    sparse: torch.Tensor | None = None,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache; Triton on CUDA, the torch reference elsewhere."""
    fn = mla_attention_triton if use_triton(q_lat) else mla_attention_ref
    return fn(q_lat, q_rot, latent_cache, rope_cache, tables, lens, scale, indices, sparse, latent_scale)
