"""Decode attention of a compressed layer (DeepSeek-V4's CSA / HCA): one query row per sequence attends, in ONE
softmax, to its window's latent rows, the compressed entries it sees, and its head's sink (a logit with no value).

``q [R, H, D]``; this step's latent rows ``kv [R, D]`` (K read as V); the window ring ``[slots, cap, 1, D]``
(position ``j`` at ``j % cap``, the ``cap`` positions before the row); the entry pool ``[blocks, per_block, 1, D]``
and ``tables [R, W]``: entry ``e`` of row ``r`` sits at ``pool[tables[r, e // per_block], e % per_block]``
(``dgpp.nn.compressed_decode.entry_table`` builds that table from the block table). The row at ``pos`` attends
window positions ``pos - min(pos, cap) .. pos`` and its complete entries ``0 .. (pos + 1) // ratio - 1``: all of
them, or with ``picks [R, K]`` (an indexer's selection, any order) the first ``min(complete, K)`` of
``picks[r]``, and with ``counts [R]`` at most ``counts[r]`` of them (a selection shorter than ``K``; 0: a
window-only layer). ``sinks [H]`` fp32. A padding row (state slot -1 or ``seq_lens`` 0) gets zeros.

The Triton path also reads rings and pools held block-scaled (``packed``, ``dgpp.kernels.block_scaled_tiles``):
ring rows of FP8 codes + E8M0 scales and entries of FP4 nibbles + E4M3 (or E8M0) scales, bytes ``uint8``, each tile
decoded in registers to the values a torch decode of the rows gives; ``kv`` stays in the compute dtype.

The Triton path gives one program to each (row, block of ``BLOCK_H`` heads, split): the row's keys (window,
current row, entries) are one list, walked in ``BLOCK_N`` tiles, each latent row loaded once for both products.
A row's list is cut into splits of ``max(MIN_SPLIT_KEYS, ceil(n / SPLITS))`` keys (a ``BLOCK_N`` multiple) from
its own length ``n`` alone, split 0 seeds its online softmax with the sink, and a second kernel merges the
splits in a fixed order, so a row's bits do not depend on the rows beside it. A row of one split is written by
split 0 directly. No host value is read: a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.block_scaled_tiles import PackedKeyForms, packed_fp4_tile, packed_fp8_tile
from dgpp.kernels.online_softmax import attend_latent_tile, finish_split, merge_splits

SPLITS = 8  # the grid's splits per row; a row uses as many as its own length needs
MIN_SPLIT_KEYS = 128  # keys per split at least: below it the merge's partials cost more than they buy
_BLOCK_N = 16  # keys per inner step: a 16 x 512 latent tile (~160 registers a thread on sm_90; 32 keys: ~230)
_BLOCK_H = 16  # heads per program: they share every latent byte it loads


def _entry_count(
    positions: torch.Tensor, ratio: int, picks: torch.Tensor | None, counts: torch.Tensor | None
) -> torch.Tensor:
    complete = torch.div(positions + 1, ratio, rounding_mode="floor")
    if picks is not None:
        complete = complete.clamp(max=picks.shape[1])
    return complete if counts is None else torch.minimum(complete, counts)


def entry_rows(pool: torch.Tensor, tables: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
    """``[R, n, D]``: entries ``entry [R, n]`` of each row from the pool through its entry table."""
    per_block = pool.shape[1]
    blocks = tables.gather(1, torch.div(entry, per_block, rounding_mode="floor")).long().clamp(min=0)
    return pool[blocks, entry % per_block, 0]


class CompressedDecodeInputs(NamedTuple):
    """One decode step's inputs, as the module docstring names them."""

    q: torch.Tensor
    kv: torch.Tensor
    ring: torch.Tensor
    pool: torch.Tensor
    tables: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    sinks: torch.Tensor
    scale: float
    ratio: int
    picks: torch.Tensor | None = None
    counts: torch.Tensor | None = None


def compressed_decode_attention_ref(step: CompressedDecodeInputs) -> torch.Tensor:
    """Batched torch form (fp32 math; no host sync): every row padded to the widest key list, masked."""
    q, kv, ring, pool, tables, slots, positions, seq_lens, sinks, scale, ratio, picks, counts = step
    rows, cap = q.shape[0], ring.shape[1]
    live = (slots >= 0) & (seq_lens > 0)
    old_pos = positions[:, None] - cap + torch.arange(cap, device=q.device)[None]
    old = ring[slots.clamp(min=0)[:, None], old_pos.clamp(min=0) % cap, 0]
    if picks is None:
        entry = torch.arange(tables.shape[1] * pool.shape[1], device=q.device)[None].expand(rows, -1)
    else:
        entry = picks.long()
    entries = entry_rows(pool, tables, entry)
    seen = (
        torch.arange(entry.shape[1], device=q.device)[None]
        < _entry_count(positions, ratio, picks, counts)[:, None]
    )
    keys = torch.cat([old.to(kv.dtype), kv[:, None], entries.to(kv.dtype)], 1).float()
    valid = torch.cat([old_pos >= 0, torch.ones_like(live)[:, None], seen], 1)
    scores = torch.einsum("bhd,bld->bhl", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    scores = torch.cat([scores, sinks.float()[None, :, None].expand(rows, -1, 1)], dim=-1)
    probs = scores.softmax(dim=-1)[..., :-1]
    out = torch.einsum("bhl,bld->bhd", probs, keys)
    return torch.where(live[:, None, None], out, 0.0).to(q.dtype)


@triton.jit
def _row_keys(
    pos_ptr,
    slot_ptr,
    len_ptr,
    cnt_ptr,
    r,
    cap,
    ratio,
    num_picks,
    HAS_PICKS: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):
    """(position, window rows from the ring, keys in all) of row ``r``: 0 keys for a padding row."""
    pos = tl.load(pos_ptr + r).to(tl.int32)  # 32-bit index math: 64-bit division costs registers
    live = (tl.load(slot_ptr + r) >= 0) & (tl.load(len_ptr + r) > 0)
    n_old = tl.minimum(pos, cap)
    n_entries = (pos + 1) // ratio
    if HAS_PICKS:
        n_entries = tl.minimum(n_entries, num_picks)
    if HAS_COUNTS:
        n_entries = tl.minimum(n_entries, tl.load(cnt_ptr + r).to(tl.int32))
    return pos, n_old, tl.where(live, n_old + 1 + n_entries, 0)


@triton.jit
def _row_split(n, num_splits, MIN_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(keys per split, splits used) of a row of ``n`` keys."""
    per_split = tl.maximum(tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N, MIN_KEYS)
    return per_split, tl.cdiv(n, per_split)


@triton.jit
def _key_tile(
    ring_ptr,
    ring8_ptr,
    pool_ptr,
    pool8_ptr,
    kv_ptr,
    ring_at,
    entry_at,
    kv_at,
    is_old,
    is_entry,
    jmask,
    cols,
    dmask,
    dim,
    PACKED: tl.constexpr,
    RING_BLOCK: tl.constexpr,
    ENTRY_BLOCK: tl.constexpr,
    ENTRY_E8M0: tl.constexpr,
):
    """``[N, D]`` latent rows in ``kv``'s dtype: window rows from the ring at ``ring_at``, entries from the pool at
    ``entry_at`` and the current row at ``kv_at`` (element offsets), as stored or, ``PACKED``, decoded from their
    block-scaled bytes (each source read only where its rows are)."""
    if PACKED:
        dtype = kv_ptr.dtype.element_ty
        valid = jmask[:, None] & dmask[None, :]
        old = packed_fp8_tile(
            ring_ptr, ring8_ptr, ring_at, cols, valid & is_old[:, None], dim, dtype, RING_BLOCK
        )
        entry = packed_fp4_tile(
            pool_ptr,
            pool8_ptr,
            entry_at,
            cols,
            valid & is_entry[:, None],
            dim,
            dtype,
            ENTRY_BLOCK,
            ENTRY_E8M0,
        )
        is_new = ~(is_old | is_entry)
        new = tl.load(
            kv_ptr + (kv_at + tl.zeros_like(ring_at))[:, None] + cols[None, :],
            mask=valid & is_new[:, None],
            other=0.0,
        )
        lat = tl.where(is_old[:, None], old, tl.where(is_entry[:, None], entry, new))
    else:
        base = tl.where(is_old, ring_ptr + ring_at, tl.where(is_entry, pool_ptr + entry_at, kv_ptr + kv_at))
        lat = tl.load(base[:, None] + cols[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0)
    return lat


@triton.jit
def _split_kernel(
    q_ptr,
    kv_ptr,
    ring_ptr,
    ring8_ptr,
    pool_ptr,
    pool8_ptr,
    tab_ptr,
    picks_ptr,
    cnt_ptr,
    slot_ptr,
    pos_ptr,
    len_ptr,
    sink_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale,
    heads,
    dim,
    cap,
    ratio,
    per_block,
    num_picks,
    num_splits,
    q_r,
    q_h,
    kv_r,
    ring_s,
    ring_t,
    pool_b,
    pool_e,
    tab_r,
    tab_c,
    picks_r,
    o_r,
    o_h,
    HAS_PICKS: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    MIN_KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    PACKED: tl.constexpr,
    RING_BLOCK: tl.constexpr,
    ENTRY_BLOCK: tl.constexpr,
    ENTRY_E8M0: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    pos, n_old, n = _row_keys(
        pos_ptr, slot_ptr, len_ptr, cnt_ptr, r, cap, ratio, num_picks, HAS_PICKS, HAS_COUNTS
    )
    per_split, used = _row_split(n, num_splits, MIN_KEYS, BLOCK_N)
    if split < tl.maximum(used, 1):  # a padding row (n 0) still runs split 0, which writes its zeros
        hmask = h < heads
        cols = tl.arange(0, BLOCK_D)
        dmask = cols < dim
        q = tl.load(
            q_ptr + r * q_r + h[:, None] * q_h + cols[None, :],
            mask=hmask[:, None] & dmask[None, :],
            other=0.0,
        )
        slot = tl.maximum(tl.load(slot_ptr + r), 0).to(tl.int64)
        # split 0 starts from the sink: a logit whose value is zero
        sink = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        start = split * per_split
        end = tl.minimum(n, start + per_split)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            jmask = j < end
            is_old = j < n_old
            is_entry = j > n_old
            ring_row = tl.where(is_old, pos - n_old + j, 0) % cap
            e = tl.where(is_entry, j - n_old - 1, 0)
            if HAS_PICKS:
                e = tl.load(picks_ptr + r * picks_r + e, mask=jmask & is_entry, other=0)
            block = tl.load(tab_ptr + r * tab_r + (e // per_block) * tab_c, mask=jmask & is_entry, other=0)
            block = tl.maximum(block, 0).to(tl.int64)
            lat = _key_tile(
                ring_ptr,
                ring8_ptr,
                pool_ptr,
                pool8_ptr,
                kv_ptr,
                slot * ring_s + ring_row.to(tl.int64) * ring_t,
                block * pool_b + (e % per_block).to(tl.int64) * pool_e,
                r * kv_r,
                is_old,
                is_entry,
                jmask,
                cols,
                dmask,
                dim,
                PACKED,
                RING_BLOCK,
                ENTRY_BLOCK,
                ENTRY_E8M0,
            )
            acc, m_i, l_i = attend_latent_tile(q, lat, jmask, acc, m_i, l_i, scale, PRECISION)
        # split 0 holds the sink, so l_i >= 1 there and in the merge: the zero guards never fire
        out_ptrs = out_ptr + r * o_r + h[:, None] * o_h + cols[None, :]
        row = (r * heads + h) * num_splits + split
        omask = hmask[:, None] & dmask[None, :]
        finish_split(out_ptrs, part_acc_ptr, part_ml_ptr, row, acc, m_i, l_i, used, omask, hmask, BLOCK_D)


@triton.jit
def _merge_kernel(
    part_acc_ptr,
    part_ml_ptr,
    slot_ptr,
    pos_ptr,
    len_ptr,
    cnt_ptr,
    out_ptr,
    heads,
    dim,
    cap,
    ratio,
    num_picks,
    num_splits,
    o_r,
    o_h,
    HAS_PICKS: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    MIN_KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    _pos, _n_old, n = _row_keys(
        pos_ptr, slot_ptr, len_ptr, cnt_ptr, r, cap, ratio, num_picks, HAS_PICKS, HAS_COUNTS
    )
    _per_split, used = _row_split(n, num_splits, MIN_KEYS, BLOCK_N)
    if used > 1:  # a one-split row was written by split 0 itself
        first = (r * heads + h) * num_splits
        merge_splits(
            part_acc_ptr, part_ml_ptr, out_ptr + r * o_r + h * o_h, first, used, dim, BLOCK_S, BLOCK_D
        )


def _check_latents(step: CompressedDecodeInputs, packed: PackedKeyForms | None) -> None:
    """Ring and pool as ``kv``'s dtype, or (``packed``) byte rows of the widths their forms give."""
    kv, ring, pool, dim = step.kv, step.ring, step.pool, step.q.shape[-1]
    if packed is None:
        if not (ring.dtype == pool.dtype == kv.dtype):
            raise ValueError(
                f"latent rows, ring and pool must share a dtype: {kv.dtype}, {ring.dtype}, {pool.dtype}"
            )
        return
    widths = (dim + dim // packed.ring_block, dim // 2 + dim // packed.entry_block)
    if ring.dtype != torch.uint8 or pool.dtype != torch.uint8 or (ring.shape[-1], pool.shape[-1]) != widths:
        raise ValueError(
            f"packed ring and pool must be uint8 rows of {widths} bytes for {dim} values: "
            f"{ring.dtype} {ring.shape[-1]}, {pool.dtype} {pool.shape[-1]}"
        )


def compressed_decode_attention_triton(
    step: CompressedDecodeInputs,
    splits: int = SPLITS,
    min_split_keys: int = MIN_SPLIT_KEYS,
    packed: PackedKeyForms | None = None,
) -> torch.Tensor:
    """``splits`` and ``min_split_keys`` (a ``_BLOCK_N`` multiple) fix how a row's keys are cut: constants of the
    caller, never functions of the batch. ``packed``: the ring and pool hold block-scaled bytes in these forms."""
    q, kv, ring, pool, tables, slots, positions, seq_lens, sinks, scale, ratio, picks, counts = step
    rows, heads, dim = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    if min_split_keys % _BLOCK_N or splits < 1:
        raise ValueError(
            f"min_split_keys {min_split_keys} must be a multiple of {_BLOCK_N}, splits {splits} >= 1"
        )
    _check_latents(step, packed)
    forms = packed or PackedKeyForms()
    # the float8 views of the same bytes, for the E4M3 codes and scales
    ring8, pool8 = (
        (ring.view(torch.float8_e4m3fn), pool.view(torch.float8_e4m3fn)) if packed else (ring, pool)
    )
    block_d, block_h = next_pow2(dim), min(_BLOCK_H, max(16, next_pow2(heads)))
    part_acc = torch.empty(rows, heads, splits, block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    has_picks = picks is not None
    chosen = picks if picks is not None else positions  # never read without picks
    num_picks = chosen.shape[1] if picks is not None else 0
    has_counts = counts is not None
    row_counts = counts if counts is not None else positions  # never read without counts
    common = dict(
        HAS_PICKS=has_picks, HAS_COUNTS=has_counts, MIN_KEYS=min_split_keys, BLOCK_N=_BLOCK_N, BLOCK_D=block_d
    )
    _split_kernel[(rows, triton.cdiv(heads, block_h), splits)](
        q,
        kv,
        ring,
        ring8,
        pool,
        pool8,
        tables,
        chosen,
        row_counts,
        slots,
        positions,
        seq_lens,
        sinks,
        out,
        part_acc,
        part_ml,
        float(scale),
        heads,
        dim,
        ring.shape[1],
        ratio,
        pool.shape[1],
        num_picks,
        splits,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        ring.stride(0),
        ring.stride(1),
        pool.stride(0),
        pool.stride(1),
        tables.stride(0),
        tables.stride(1),
        chosen.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_H=block_h,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PACKED=packed is not None,
        RING_BLOCK=forms.ring_block,
        ENTRY_BLOCK=forms.entry_block,
        ENTRY_E8M0=forms.entry_e8m0,
        num_warps=4,
        **common,
    )
    if splits > 1:
        _merge_kernel[(rows, heads)](
            part_acc,
            part_ml,
            slots,
            positions,
            seq_lens,
            row_counts,
            out,
            heads,
            dim,
            ring.shape[1],
            ratio,
            num_picks,
            splits,
            out.stride(0),
            out.stride(1),
            BLOCK_S=max(2, next_pow2(splits)),
            num_warps=4,
            **common,
        )
    return out


def compressed_decode_attention(step: CompressedDecodeInputs) -> torch.Tensor:
    """Compressed-layer decode attention ``[R, H, D]``; Triton on CUDA, the torch form elsewhere."""
    return (compressed_decode_attention_triton if use_triton(step.q) else compressed_decode_attention_ref)(
        step
    )
