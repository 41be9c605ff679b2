"""Prompt rows of a full-attention layer with sinks over the paged pool, ``ROWS`` rows of a sequence a program.

``dgpp.kernels.window_attention`` gives each (row, KV head) one program, which walks the row's keys from position 0
in ``BLOCK_N`` tiles. Over an 8,192-token prompt that reads each key tile once per row. A full-attention row's tiles
start at position 0 whatever the row, so the rows of one sequence can share them: here one program takes ``ROWS``
consecutive rows of a sequence (a block of ``row_blocks``), loads each key and value tile once, and folds it into
every row whose span it reaches. Each row keeps its own running max, sum and output, its scores come from the
same ``[BLOCK_G, D]`` query tile and the same product as in the one-row kernel, and a tile past a row's position
leaves that row's state as it was. So a row's output does not depend on which rows share its program, or on how
its prompt was chunked.

Shapes and sources as the paged branch of ``window_attention`` (``window`` 0): ``q [T, Hq, D]``, the pool
``[num_blocks, block_size, Hk, D]`` through ``block_tables``, this step's K/V already stored, optional e4m3 rows
with their scales. ``row_blocks [B]`` int32: the first row of each block, every block inside one sequence (the
caller cuts each sequence's rows into blocks of ``ROWS`` from its first row: ``prompt_row_blocks``). On CUDA,
``dgpp.nn.paged_sink_attention`` sends a step's prompt rows here.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton
from dgpp.kernels.kv_fp8 import KVScales, e4m3_words
from dgpp.kernels.online_softmax import normalized, softmax_step
from dgpp.kernels.window_attention import head_tiles, load_paged_tile, narrow_heads, row_sequences

ROWS = 4  # rows a program holds the state of (four [BLOCK_G, Dv] fp32 accumulators)
_WARPS = 4  # the one-row kernel's: the row max and sum reduce over the same layout, so the same bits


def prompt_row_blocks(q_lens: list[int], device: torch.device) -> torch.Tensor:
    """The first row of each ``ROWS``-row block, each sequence's rows cut from its first row (int32, on
    ``device``)."""
    starts, first = [], 0
    for n in q_lens:
        starts.extend(range(first, first + n, ROWS))
        first += n
    return torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True)


@triton.jit
def _fold_tile(q, kt, v, acc, m_i, l_i, tok0, toks, hi, scale, PRECISION: tl.constexpr):
    """One row's state after a shared key tile: the one-row kernel's step where the tile starts inside the
    row's span, the state unchanged where it starts past it."""
    s = tl.dot(q, kt, input_precision=PRECISION) * scale
    s = tl.where((toks < hi)[None, :], s, float("-inf"))
    new_acc, new_m, new_l = softmax_step(s, v, acc, m_i, l_i, PRECISION)
    reached = tok0 < hi
    return tl.where(reached, new_acc, acc), tl.where(reached, new_m, m_i), tl.where(reached, new_l, l_i)


@triton.jit
def _load_query(q_ptr, row, ok, heads, gmask, d, head_dim, q_t, q_h):
    return tl.load(
        q_ptr + row * q_t + heads[:, None] * q_h + d[None, :],
        mask=ok & gmask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )


@triton.jit
def _store_row(out_ptr, row, ok, acc, l_i, heads, gmask, dv, v_dim, o_t, o_h):
    tl.store(
        out_ptr + row * o_t + heads[:, None] * o_h + dv[None, :],
        normalized(acc, l_i).to(out_ptr.dtype.element_ty),
        mask=ok & gmask[:, None] & (dv[None, :] < v_dim),
    )


@triton.jit
def _full_attention_rows_kernel(
    q_ptr,
    ks_ptr,
    vs_ptr,
    ksc_ptr,
    vsc_ptr,
    loc_ptr,
    blocks_ptr,
    row_seq_ptr,
    qsl_ptr,
    ctx_ptr,
    lens_ptr,
    sink_ptr,
    out_ptr,
    scale,
    group,
    head_dim,
    v_dim,
    cap,
    q_t,
    q_h,
    ks_0,
    ks_1,
    ks_2,
    vs_0,
    vs_1,
    vs_2,
    sc_0,
    sc_1,
    sc_2,
    loc_b,
    o_t,
    o_h,
    HAS_SINKS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    first = tl.load(blocks_ptr + tl.program_id(0)).to(tl.int64)
    kvh = tl.program_id(1)
    hg = tl.program_id(2)
    b = tl.load(row_seq_ptr + first).to(tl.int64)
    start = tl.load(qsl_ptr + b).to(tl.int64)
    end = tl.load(qsl_ptr + b + 1).to(tl.int64)
    ctx = tl.load(ctx_ptr + b).to(tl.int64)
    live = tl.load(lens_ptr + b) > 0
    # the block's rows (ROWS = 4): a row past its sequence or a sequence that walks no keys (seq_len 0) has
    # hi = 0, so no tile reaches it, and it is not stored
    r0, r1, r2, r3 = first, first + 1, first + 2, first + 3
    ok0, ok1, ok2, ok3 = live & (r0 < end), live & (r1 < end), live & (r2 < end), live & (r3 < end)
    hi0 = tl.where(ok0, ctx + (r0 - start) + 1, 0)
    hi1 = tl.where(ok1, ctx + (r1 - start) + 1, 0)
    hi2 = tl.where(ok2, ctx + (r2 - start) + 1, 0)
    hi3 = tl.where(ok3, ctx + (r3 - start) + 1, 0)
    hi = tl.maximum(tl.maximum(hi0, hi1), tl.maximum(hi2, hi3))

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    heads = kvh * group + hg * BLOCK_G + g
    gmask = hg * BLOCK_G + g < group
    q0 = _load_query(q_ptr, r0, ok0, heads, gmask, d, head_dim, q_t, q_h)
    q1 = _load_query(q_ptr, r1, ok1, heads, gmask, d, head_dim, q_t, q_h)
    q2 = _load_query(q_ptr, r2, ok2, heads, gmask, d, head_dim, q_t, q_h)
    q3 = _load_query(q_ptr, r3, ok3, heads, gmask, d, head_dim, q_t, q_h)
    if HAS_SINKS:  # as the one-row kernel: the sink seeds the running max, and exp(sink - m) the sum
        m0 = tl.load(sink_ptr + heads, mask=gmask, other=0.0).to(tl.float32)
        l0 = tl.full([BLOCK_G], 1.0, tl.float32)
    else:
        m0 = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l0 = tl.zeros([BLOCK_G], tl.float32)
    m1, m2, m3 = m0, m0, m0
    l1, l2, l3 = l0, l0, l0
    acc0 = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for tok0 in range(0, hi, BLOCK_N):
        toks = tok0 + tl.arange(0, BLOCK_N)
        tmask = toks < hi
        kt, v = load_paged_tile(
            (ks_ptr, vs_ptr, ksc_ptr, vsc_ptr),
            loc_ptr + b * loc_b,
            kvh,
            toks,
            tmask,
            cap,
            (head_dim, v_dim),
            (ks_0, ks_1, ks_2, vs_0, vs_1, vs_2, sc_0, sc_1, sc_2),
            q0.dtype,
            BLOCK_D,
            BLOCK_DV,
            HAS_SCALES,
        )
        acc0, m0, l0 = _fold_tile(q0, kt, v, acc0, m0, l0, tok0, toks, hi0, scale, PRECISION)
        acc1, m1, l1 = _fold_tile(q1, kt, v, acc1, m1, l1, tok0, toks, hi1, scale, PRECISION)
        acc2, m2, l2 = _fold_tile(q2, kt, v, acc2, m2, l2, tok0, toks, hi2, scale, PRECISION)
        acc3, m3, l3 = _fold_tile(q3, kt, v, acc3, m3, l3, tok0, toks, hi3, scale, PRECISION)
    _store_row(out_ptr, r0, ok0, acc0, l0, heads, gmask, dv, v_dim, o_t, o_h)
    _store_row(out_ptr, r1, ok1, acc1, l1, heads, gmask, dv, v_dim, o_t, o_h)
    _store_row(out_ptr, r2, ok2, acc2, l2, heads, gmask, dv, v_dim, o_t, o_h)
    _store_row(out_ptr, r3, ok3, acc3, l3, heads, gmask, dv, v_dim, o_t, o_h)


def takes_rows(q: torch.Tensor, src_v: torch.Tensor) -> bool:
    """Whether this head shape runs here: narrow heads (up to 256 wide), whose one-row tiles take a KV head's whole
    query group; wider ones split their query heads and four rows of state would not fit."""
    return narrow_heads(q.shape[-1], src_v.shape[-1])


def full_attention_rows_triton(
    q: torch.Tensor,
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    row_blocks: torch.Tensor,
    scales: KVScales = None,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, Hq, Dv]``: every row's full-context attention (zeros for rows of a sequence whose ``seq_lens`` is
    0); the arguments as ``window_attention``'s paged form with ``window`` 0, ``row_blocks`` from
    ``prompt_row_blocks``. The head shape must pass ``takes_rows``."""
    rows, hq, head_dim = q.shape
    hk, v_dim = src_k.shape[2], src_v.shape[-1]
    if not takes_rows(q, src_v):
        raise ValueError(f"full_attention_rows: heads {head_dim}/{v_dim} wide under {hq // hk} a KV head")
    out = torch.zeros(rows, hq, v_dim, dtype=q.dtype, device=q.device)
    if rows == 0 or row_blocks.numel() == 0:
        return out
    row_seq = row_sequences(query_start_loc, rows) if row_seq is None else row_seq
    block_n, block_g, head_groups = head_tiles(hq // hk, head_dim, v_dim)  # the one-row kernel's tiles
    k_sc, v_sc = scales if scales is not None else (src_k, src_v)  # unread without scales
    if scales is not None:
        src_k, src_v = e4m3_words(src_k), e4m3_words(src_v)
    _full_attention_rows_kernel[(row_blocks.numel(), hk, head_groups)](
        q,
        src_k,
        src_v,
        k_sc,
        v_sc,
        block_tables,
        row_blocks,
        row_seq,
        query_start_loc,
        context_lens,
        seq_lens,
        sinks if sinks is not None else q,
        out,
        float(scale),
        hq // hk,
        head_dim,
        v_dim,
        src_k.shape[1],
        q.stride(0),
        q.stride(1),
        src_k.stride(0),
        src_k.stride(1),
        src_k.stride(2),
        src_v.stride(0),
        src_v.stride(1),
        src_v.stride(2),
        k_sc.stride(0),
        k_sc.stride(1),
        k_sc.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HAS_SINKS=sinks is not None,
        HAS_SCALES=scales is not None,
        BLOCK_N=block_n,
        BLOCK_G=block_g,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_DV=next_pow2(v_dim),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=_WARPS,
    )
    return out
