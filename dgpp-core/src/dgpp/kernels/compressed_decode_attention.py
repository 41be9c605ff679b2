"""Decode attention of a compressed layer (DeepSeek-V4's CSA / HCA): one query row per sequence attends, in ONE
softmax, to its window's latent rows, the compressed entries it sees, and its head's sink (a logit with no value).

``q [R, H, D]``; this step's latent rows ``kv [R, D]`` (K read as V); the window ring ``[slots, cap, 1, D]``
(position ``j`` at ``j % cap``, the ``cap`` positions before the row); the entry pool ``[blocks, per_block, 1, D]``
and ``tables [R, W]``: entry ``e`` of row ``r`` sits at ``pool[tables[r, e // per_block], e % per_block]``
(``dgpp.nn.compressed_decode.entry_table`` builds that table from the block table). The row at ``pos`` attends
window positions ``pos - min(pos, cap) .. pos`` and its complete entries ``0 .. (pos + 1) // ratio - 1``: all of
them, or with ``picks [R, K]`` (an indexer's selection, any order) the first ``min(complete, K)`` of
``picks[r]``. ``sinks [H]`` fp32. A padding row (state slot -1 or ``seq_lens`` 0) gets zeros.

The Triton path gives one program to each (row, block of ``BLOCK_H`` heads, split): the row's keys (window,
current row, entries) are one list, walked in ``BLOCK_N`` tiles, each latent row loaded once for both products.
A row's list is cut into splits of ``max(MIN_SPLIT_KEYS, ceil(n / SPLITS))`` keys (a ``BLOCK_N`` multiple) from
its own length ``n`` alone, split 0 seeds its online softmax with the sink, and a second kernel merges the
splits in a fixed order, so a row's bits do not depend on the rows beside it. A row of one split is written by
split 0 directly. No host value is read: a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton

SPLITS = 8  # the grid's splits per row; a row uses as many as its own length needs
MIN_SPLIT_KEYS = 128  # keys per split at least: below it the merge's partials cost more than they buy
_BLOCK_N = 16  # keys per inner step: a 16 x 512 latent tile (~160 registers a thread on sm_90; 32 keys: ~230)
_BLOCK_H = 16  # heads per program: they share every latent byte it loads


def _entry_count(positions: torch.Tensor, ratio: int, picks: torch.Tensor | None) -> torch.Tensor:
    complete = torch.div(positions + 1, ratio, rounding_mode="floor")
    return complete if picks is None else complete.clamp(max=picks.shape[1])


def entry_rows(pool: torch.Tensor, tables: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
    """``[R, n, D]``: entries ``entry [R, n]`` of each row from the pool through its entry table."""
    per_block = pool.shape[1]
    blocks = tables.gather(1, torch.div(entry, per_block, rounding_mode="floor")).long().clamp(min=0)
    return pool[blocks, entry % per_block, 0]


def compressed_decode_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    pool: torch.Tensor,
    tables: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    ratio: int,
    picks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched torch form (fp32 math; no host sync): every row padded to the widest key list, masked."""
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
        torch.arange(entry.shape[1], device=q.device)[None] < _entry_count(positions, ratio, picks)[:, None]
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
def _row_keys(pos_ptr, slot_ptr, len_ptr, r, cap, ratio, num_picks, HAS_PICKS: tl.constexpr):
    """(position, window rows from the ring, keys in all) of row ``r``: 0 keys for a padding row."""
    pos = tl.load(pos_ptr + r).to(tl.int32)  # 32-bit index math: 64-bit division costs registers
    live = (tl.load(slot_ptr + r) >= 0) & (tl.load(len_ptr + r) > 0)
    n_old = tl.minimum(pos, cap)
    n_entries = (pos + 1) // ratio
    if HAS_PICKS:
        n_entries = tl.minimum(n_entries, num_picks)
    return pos, n_old, tl.where(live, n_old + 1 + n_entries, 0)


@triton.jit
def _row_split(n, num_splits, MIN_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(keys per split, splits used) of a row of ``n`` keys."""
    per_split = tl.maximum(tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N, MIN_KEYS)
    return per_split, tl.cdiv(n, per_split)


@triton.jit
def _split_kernel(
    q_ptr,
    kv_ptr,
    ring_ptr,
    pool_ptr,
    tab_ptr,
    picks_ptr,
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
    MIN_KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    pos, n_old, n = _row_keys(pos_ptr, slot_ptr, len_ptr, r, cap, ratio, num_picks, HAS_PICKS)
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
            base = tl.where(
                is_old,
                ring_ptr + slot * ring_s + ring_row.to(tl.int64) * ring_t,
                tl.where(
                    is_entry,
                    pool_ptr + block * pool_b + (e % per_block).to(tl.int64) * pool_e,
                    kv_ptr + r * kv_r,
                ),
            )
            lat = tl.load(base[:, None] + cols[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(lat), input_precision=PRECISION) * scale
            s = tl.where(jmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PRECISION)
            m_i = m_new
        omask = hmask[:, None] & dmask[None, :]
        if used <= 1:  # the whole row in split 0 (or a padding row): the answer itself
            tl.store(
                out_ptr + r * o_r + h[:, None] * o_h + cols[None, :],
                (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                mask=omask,
            )
        else:  # partials [R, H, splits, BLOCK_D] and [R, H, splits, 2] for the merge
            row = (r * heads + h) * num_splits + split
            tl.store(part_acc_ptr + row[:, None] * BLOCK_D + cols[None, :], acc, mask=omask)
            tl.store(part_ml_ptr + row * 2, m_i, mask=hmask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=hmask)


@triton.jit
def _merge_kernel(
    part_acc_ptr,
    part_ml_ptr,
    slot_ptr,
    pos_ptr,
    len_ptr,
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
    MIN_KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    _pos, _n_old, n = _row_keys(pos_ptr, slot_ptr, len_ptr, r, cap, ratio, num_picks, HAS_PICKS)
    _per_split, used = _row_split(n, num_splits, MIN_KEYS, BLOCK_N)
    if used > 1:  # a one-split row was written by split 0 itself
        splits = tl.arange(0, BLOCK_S)
        smask = splits < used
        row = (r * heads + h) * num_splits + splits
        m = tl.load(part_ml_ptr + row * 2, mask=smask, other=float("-inf"))
        lsum = tl.load(part_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
        w = tl.where(smask, tl.exp(m - tl.max(m, axis=0)), 0.0)
        cols = tl.arange(0, BLOCK_D)
        acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + cols[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
        tl.store(out_ptr + r * o_r + h * o_h + cols, out.to(out_ptr.dtype.element_ty), mask=cols < dim)


def compressed_decode_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    pool: torch.Tensor,
    tables: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    ratio: int,
    picks: torch.Tensor | None = None,
    splits: int = SPLITS,
    min_split_keys: int = MIN_SPLIT_KEYS,
) -> torch.Tensor:
    """``splits`` and ``min_split_keys`` (a ``_BLOCK_N`` multiple) fix how a row's keys are cut: constants of the
    caller, never functions of the batch."""
    rows, heads, dim = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    if min_split_keys % _BLOCK_N or splits < 1:
        raise ValueError(
            f"min_split_keys {min_split_keys} must be a multiple of {_BLOCK_N}, splits {splits} >= 1"
        )
    if not (ring.dtype == pool.dtype == kv.dtype):
        raise ValueError(
            f"latent rows, ring and pool must share a dtype: {kv.dtype}, {ring.dtype}, {pool.dtype}"
        )
    block_d, block_h = next_pow2(dim), min(_BLOCK_H, max(16, next_pow2(heads)))
    part_acc = torch.empty(rows, heads, splits, block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    has_picks = picks is not None
    chosen = picks if picks is not None else positions  # never read without picks
    num_picks = chosen.shape[1] if picks is not None else 0
    common = dict(HAS_PICKS=has_picks, MIN_KEYS=min_split_keys, BLOCK_N=_BLOCK_N, BLOCK_D=block_d)
    _split_kernel[(rows, triton.cdiv(heads, block_h), splits)](
        q,
        kv,
        ring,
        pool,
        tables,
        chosen,
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


def compressed_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    pool: torch.Tensor,
    tables: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    ratio: int,
    picks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compressed-layer decode attention ``[R, H, D]``; Triton on CUDA, the torch form elsewhere."""
    fn = compressed_decode_attention_triton if use_triton(q) else compressed_decode_attention_ref
    return fn(q, kv, ring, pool, tables, slots, positions, seq_lens, sinks, scale, ratio, picks)
