"""Manifold hyper-connections' per-row math after the ``fn`` projection, one launch per pass.

``hc_collapse``: from the projection's ``mixes [T, (2+N)*N]`` (fp32), one program per token row holds the
``pre | post | comb`` logits in registers, computes ``pre = sigmoid(w·scale0 + b) + eps``,
``post = 2·sigmoid(w·scale1 + b)`` and ``comb = sinkhorn(softmax(w·scale2 + b) + eps)`` (every Sinkhorn pass
in registers), and writes the sublayer input ``x = sum_j pre_j · s_j`` (fp32 sum in stream order, rounded to
the streams' dtype) with ``post`` and ``comb``. With ``head=True`` it is ``HyperHead``'s collapse: ``pre`` only
(``mixes [T, N]``, one scale). The torch chain it replaces launches ~200 ops per pass at ``N = 4`` and 20
iterations (two per Sinkhorn half-pass).

``hc_expand``: ``s'_k = post_k·out + sum_j comb[j, k]·s_j`` with the torch chain's roundings: ``post`` rounded
to the streams' dtype before the product, the product rounded, the comb mix summed in fp32 (``comb`` rounded
to the streams' dtype first) and rounded, then the two added in that dtype.

The fp32 math follows the torch chain op for op: separate multiplies and adds (launched with fp contraction
off, so no FMA), IEEE divisions (``div_rn``), libdevice ``exp``. Reductions over the ``N`` streams (softmax
and Sinkhorn sums) may add in another order than torch's, so ``comb`` can differ from it in the last places
(measured well within 1e-6 in fp32). ``hc_collapse_given`` is the single-pass form (DeepSeek-V4.1): the same
coefficients, ``pre`` returned, and ``x`` weighted by the previous sublayer's ``pre``. Everything is per row, so
a row's bits never depend on the other rows.

Both kernels split the hidden axis into spans, one program per (row[, stream], span): a decode step's one row
fills many SMs (hidden 4096: 16 collapse programs, 64 expand programs) where one program used to walk the whole
row. Each collapse program computes its row's ``pre`` (a few flops); the span-0 program alone runs ``post`` and
the Sinkhorn ``comb`` and stores them, while the row's other spans weight their streams. An element's math does
not depend on the split, so its bits do not either.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton
from dgpp.kernels.torch_fp32_math import NO_FMA, exp

_BLOCK_H = 256
# programs a launch aims for: a decode step's few rows split the hidden axis into spans until the SMs fill,
# many rows keep longer spans (fewer programs, each with its loop of loads)
_PROGRAMS = 264


@triton.jit
def _sigmoid(x):
    return tl.math.div_rn(1.0, 1.0 + exp(-x))


@triton.jit
def _pick(vec, idx, j):
    """``vec[j]`` as a scalar (the other lanes add exact zeros)."""
    return tl.sum(tl.where(idx == j, vec, 0.0), axis=0)


@triton.jit
def _post_and_comb(mix, base_ptr, scale_ptr, post_out, comb_out, n, iters, eps, NP: tl.constexpr):
    """A row's ``post = 2·sigmoid`` and ``comb = sinkhorn(softmax + eps)`` from its logits, stored."""
    i = tl.arange(0, NP)
    live = i < n
    post = tl.load(mix + n + i, mask=live, other=0.0) * tl.load(scale_ptr + 1)
    post = 2.0 * _sigmoid(post + tl.load(base_ptr + n + i, mask=live, other=0.0))
    tl.store(post_out + i, post, mask=live)
    r = i[:, None]
    c = i[None, :]
    cell = (r < n) & (c < n)
    logits = tl.load(mix + 2 * n + r * n + c, mask=cell, other=0.0) * tl.load(scale_ptr + 2)
    logits = logits + tl.load(base_ptr + 2 * n + r * n + c, mask=cell, other=0.0)
    # padding: far below any logit (no weight in a live row's softmax), finite (no NaN in padded rows)
    logits = tl.where(cell, logits, -1.0e30)
    e = exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(cell, tl.math.div_rn(e, tl.sum(e, axis=1)[:, None]) + eps, 0.0)
    col_live = c < n
    row_live = r < n
    comb = tl.math.div_rn(comb, tl.where(col_live, tl.sum(comb, axis=0)[None, :] + eps, 1.0))
    for _ in range(iters - 1):
        comb = tl.math.div_rn(comb, tl.where(row_live, tl.sum(comb, axis=1)[:, None] + eps, 1.0))
        comb = tl.math.div_rn(comb, tl.where(col_live, tl.sum(comb, axis=0)[None, :] + eps, 1.0))
    tl.store(comb_out + r * n + c, comb, mask=cell)


@triton.jit
def _hc_collapse_kernel(
    mix_ptr,
    base_ptr,
    scale_ptr,
    streams_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    given_ptr,
    pre_ptr,
    n,
    hidden,
    span,
    iters,
    eps,
    mix_row,
    s_row,
    s_stream,
    given_row,
    given_col,
    HEAD: tl.constexpr,
    GIVEN: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    # every span needs the row's pre (a few flops); only span 0 computes and stores the rest
    first = tile == 0
    i = tl.arange(0, NP)
    live = i < n
    mix = mix_ptr + row * mix_row
    pre = tl.load(mix + i, mask=live, other=0.0) * tl.load(scale_ptr)
    pre = pre + tl.load(base_ptr + i, mask=live, other=0.0)
    pre = _sigmoid(pre) + eps
    if not HEAD:
        if first:  # post and the Sinkhorn comb: the row's other spans weight their streams meanwhile
            _post_and_comb(
                mix, base_ptr, scale_ptr, post_ptr + row * n, comb_ptr + row * n * n, n, iters, eps, NP
            )
    if GIVEN:  # x from the given weights (the previous sublayer's pre); this row's pre is stored for the next
        tl.store(pre_ptr + row * n + i, pre, mask=live & first)
        pre = tl.load(given_ptr + row * given_row + i * given_col, mask=live, other=0.0).to(tl.float32)
    w0 = _pick(pre, i, 0)
    src = streams_ptr + row * s_row
    for h0 in range(tile * span, tl.minimum(tile * span + span, hidden), BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < hidden
        acc = w0 * tl.load(src + h, mask=hm, other=0.0).to(tl.float32)
        for j in range(1, n):
            acc = acc + _pick(pre, i, j) * tl.load(src + j * s_stream + h, mask=hm, other=0.0).to(tl.float32)
        tl.store(x_ptr + row * hidden + h, acc.to(x_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _hc_expand_kernel(
    streams_ptr,
    out_ptr,
    post_ptr,
    comb_ptr,
    new_ptr,
    n,
    hidden,
    span,
    s_row,
    s_stream,
    o_row,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    dtype = new_ptr.dtype.element_ty
    post = tl.load(post_ptr + row * n + k).to(dtype).to(tl.float32)
    comb = comb_ptr + row * n * n + k  # comb[j, k]: column k mixes the input streams j
    c0 = tl.load(comb).to(dtype).to(tl.float32)
    src = streams_ptr + row * s_row
    dst = new_ptr + row * n * hidden + k * hidden
    start = tl.program_id(2) * span
    for h0 in range(start, tl.minimum(start + span, hidden), BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < hidden
        out = tl.load(out_ptr + row * o_row + h, mask=hm, other=0.0).to(tl.float32)
        update = (post * out).to(dtype).to(tl.float32)
        mixed = c0 * tl.load(src + h, mask=hm, other=0.0).to(tl.float32)
        for j in range(1, n):
            cj = tl.load(comb + j * n).to(dtype).to(tl.float32)
            mixed = mixed + cj * tl.load(src + j * s_stream + h, mask=hm, other=0.0).to(tl.float32)
        tl.store(dst + h, (update + mixed.to(dtype).to(tl.float32)).to(dtype), mask=hm)


def _hidden_spans(programs_per_span: int, hidden: int, block: int) -> tuple[int, int]:
    """``(span, count)``: each program walks ``span`` hidden elements (a multiple of ``block``, the last span
    ragged) in ``block``-wide steps; the elements' math does not depend on the split."""
    blocks = triton.cdiv(hidden, block)
    pieces = max(1, min(blocks, _PROGRAMS // max(1, programs_per_span)))
    span = max(1, triton.cdiv(blocks, pieces)) * block
    return span, max(1, triton.cdiv(hidden, span))


def _check_streams(streams: torch.Tensor) -> None:
    if streams.dim() != 3 or streams.stride(-1) != 1:
        raise ValueError(f"streams must be [T, N, H] with a contiguous last dim, got {list(streams.shape)}")


def hc_collapse(
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    streams: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [T, H], post [T, N], comb [T, N, N])`` from ``mixes [T, (2+N)*N]`` (fp32)."""
    _check_streams(streams)
    rows, n, hidden = streams.shape
    x = torch.empty(rows, hidden, dtype=streams.dtype, device=streams.device)
    post = torch.empty(rows, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(rows, n, n, dtype=torch.float32, device=streams.device)
    _launch_collapse(mixes, base, scale, streams, x, post, comb, sinkhorn_iters, eps, head=False)
    return x, post, comb


def hc_collapse_given(
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    streams: torch.Tensor,
    given_pre: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, pre, post, comb)``: ``hc_collapse``'s coefficients with ``pre [T, N]`` returned, and ``x`` the
    streams weighted by ``given_pre [T, N]`` instead (single-pass hyper-connections: the previous sublayer's)."""
    _check_streams(streams)
    rows, n, hidden = streams.shape
    if given_pre.shape != (rows, n):
        raise ValueError(f"given_pre must be [{rows}, {n}], got {list(given_pre.shape)}")
    x = torch.empty(rows, hidden, dtype=streams.dtype, device=streams.device)
    pre = torch.empty(rows, n, dtype=torch.float32, device=streams.device)
    post = torch.empty(rows, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(rows, n, n, dtype=torch.float32, device=streams.device)
    _launch_collapse(
        mixes, base, scale, streams, x, post, comb, sinkhorn_iters, eps, head=False, given=(given_pre, pre)
    )
    return x, pre, post, comb


def hc_head(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor, *, eps: float
) -> torch.Tensor:
    """``HyperHead``'s ``x [T, H] = sum_j (sigmoid(mix_j·scale + base_j) + eps)·s_j`` from ``mixes [T, N]``."""
    _check_streams(streams)
    rows, _, hidden = streams.shape
    x = torch.empty(rows, hidden, dtype=streams.dtype, device=streams.device)
    _launch_collapse(mixes, base, scale, streams, x, x, x, 1, eps, head=True)
    return x


def _launch_collapse(
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    streams: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    iters: int,
    eps: float,
    *,
    head: bool,
    given: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    rows, n, hidden = streams.shape
    given_pre, pre_out = given if given is not None else (x, x)
    width = n if head else (2 + n) * n
    if mixes.shape != (rows, width) or mixes.stride(-1) != 1:
        raise ValueError(
            f"mixes must be [{rows}, {width}] with a contiguous last dim, got {list(mixes.shape)}"
        )
    block = min(_BLOCK_H, next_pow2(hidden))
    span, spans = _hidden_spans(rows, hidden, block)
    if rows:
        _hc_collapse_kernel[(rows, spans)](
            mixes,
            base,
            scale,
            streams,
            x,
            post,
            comb,
            given_pre,
            pre_out,
            n,
            hidden,
            span,
            iters,
            eps,
            mixes.stride(0),
            streams.stride(0),
            streams.stride(1),
            given_pre.stride(0),
            given_pre.stride(-1),
            HEAD=head,
            GIVEN=given is not None,
            NP=next_pow2(n),
            BLOCK_H=block,
            num_warps=4,
            **NO_FMA,
        )


def hc_expand(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``s'_k = post_k·out + sum_j comb[j, k]·s_j`` as ``[T, N, H]`` in the streams' dtype."""
    _check_streams(streams)
    rows, n, hidden = streams.shape
    if out.shape != (rows, hidden) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{rows}, {hidden}] with a contiguous last dim, got {list(out.shape)}")
    post, comb = post.contiguous(), comb.contiguous()
    new = torch.empty(rows, n, hidden, dtype=streams.dtype, device=streams.device)
    block = min(_BLOCK_H, next_pow2(hidden))
    span, spans = _hidden_spans(rows * n, hidden, block)
    if rows:
        _hc_expand_kernel[(rows, n, spans)](
            streams,
            out,
            post,
            comb,
            new,
            n,
            hidden,
            span,
            streams.stride(0),
            streams.stride(1),
            out.stride(0),
            BLOCK_H=block,
            num_warps=4,
            **NO_FMA,
        )
    return new
