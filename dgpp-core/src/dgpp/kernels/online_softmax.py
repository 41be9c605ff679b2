"""The online softmax the attention kernels fold their key tiles into, and the merge of split partials.

A program keeps, per query row, the running max ``m_i``, the running sum ``l_i`` of ``exp(s - m_i)`` and the
unnormalised output ``acc``; each tile of masked scores (``-inf`` where there is no key) folds in with
``softmax_step``. A row whose keys are cut into splits (flash decoding) either finishes in split 0, or stores
each split's ``(acc, m_i, l_i)`` at flat index ``(row * heads + head) * splits + split`` and ``merge_splits``
combines them in split order: a row's bits depend only on how its own keys were cut.
"""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton


@triton.jit
def probabilities(s, m_i, l_i):
    """``(p, alpha, m_new, l_i)``: a tile's unnormalised probabilities, the factor the running state is rescaled
    by, and the new running max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def softmax_step(s, v, acc, m_i, l_i, PRECISION: tl.constexpr):
    """``(acc, m_i, l_i)`` after the scores ``s [M, N]`` and values ``v [N, D]`` of one tile."""
    p, alpha, m_new, l_i = probabilities(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_latent_tile(q, k, valid, acc, m_i, l_i, scale, PRECISION: tl.constexpr):
    """One tile of keys ``k [N, D]`` read as their own values (a latent head), where ``valid``."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    return softmax_step(s, k, acc, m_i, l_i, PRECISION)


@triton.jit
def normalized(acc, l_i):
    """``acc / l_i`` per row; a row that saw no key (``l_i`` 0, ``acc`` 0) comes out as zeros."""
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def store_partials(part_acc_ptr, part_ml_ptr, row, acc, m_i, l_i, acc_mask, row_mask, BLOCK_D: tl.constexpr):
    """One split's state at flat indices ``row``: ``acc`` into ``[.., BLOCK_D]``, ``(m_i, l_i)`` into ``[.., 2]``."""
    cols = tl.arange(0, BLOCK_D)
    tl.store(part_acc_ptr + row[:, None] * BLOCK_D + cols[None, :], acc, mask=acc_mask)
    tl.store(part_ml_ptr + row * 2, m_i, mask=row_mask)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_mask)


@triton.jit
def finish_split(
    out_ptrs, part_acc_ptr, part_ml_ptr, row, acc, m_i, l_i, used, acc_mask, row_mask, BLOCK_D: tl.constexpr
):
    """The answer itself when the row used one split (or none: a padding row's zeros), else the partials."""
    if used <= 1:
        tl.store(out_ptrs, normalized(acc, l_i).to(out_ptrs.dtype.element_ty), mask=acc_mask)
    else:
        store_partials(part_acc_ptr, part_ml_ptr, row, acc, m_i, l_i, acc_mask, row_mask, BLOCK_D)


@triton.jit
def merge_splits(
    part_acc_ptr, part_ml_ptr, out_ptr, first, used, dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Writes ``out_ptr[:dim]`` from the ``used`` partials at flat indices ``first ..``, weighted in split order."""
    splits = tl.arange(0, BLOCK_S)
    smask = splits < used
    row = first + splits
    m = tl.load(part_ml_ptr + row * 2, mask=smask, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    w = tl.where(smask, tl.exp(m - tl.max(m, axis=0)), 0.0)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + cols[None, :], mask=smask[:, None], other=0.0)
    den = tl.sum(lsum * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=cols < dim)
