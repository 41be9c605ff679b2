"""A hashed n-gram embedding's decode step (one token per row), with no host reads: its table row ids, and its
gated, normed and convolved injection into a multi-stream residual.

``ngram_rows``: each row's previous ``n-1`` tokens come from ``context [slots, n-1]`` at its state slot (all EOS
for a fresh sequence: ``fresh`` set, or slot ``-1``). The token ``s`` back reads as EOS when an EOS lies
between it and the current token. Head ``h`` of order ``o`` (heads ``(o-2)·per_order ..``) hashes
``tok[t]·m0 ^ tok[t-1]·m1 ^ ... ^ tok[t-o+1]·m(o-1)`` (int64) to row ``offset_h + mixed mod size_h``. Live rows
store their last ``n-1`` tokens back as the next context; padding rows (slot -1) store nothing.

``ngram_inject``: per stream ``s`` of ``hyper [T, hc*H]``, with zero-centred RMSNorms ``N_key``, ``N_query``,
``N_conv`` (weights ``[hc*H]``): ``g_s = σ(ssqrt(N_key(key)_s · N_query(hyper)_s / √H))``, ``gated_s = g_s ·
value`` (``value [T, H]``), ``c = N_conv(gated)``, ``conv = silu(Σ_k w[:, k] · c[t - (K-1-k)·dilation])`` over the
slot's conv history ``[slots, (K-1)·dilation, hc*H]`` (zeros when fresh), and returns ``hyper + (gated + conv)``.
Live rows shift ``c`` into their history. Each elementwise result is rounded to the activation dtype as the torch
chain rounds it; norms, dot products and the conv accumulate in fp32. One program per (row, stream).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.hyper_streams import grouped_norm_ref


class NgramRowsInputs(NamedTuple):
    """One decode step's hash inputs: ``tokens [T]``, ``context [slots, n-1]`` (updated in place), ``slots [T]``,
    ``fresh [T]`` (nonzero: the sequence starts here), per-position ``multipliers [n]``, per-head ``sizes`` and
    ``offsets`` ``[heads]``."""

    tokens: torch.Tensor
    context: torch.Tensor
    slots: torch.Tensor
    fresh: torch.Tensor
    multipliers: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor
    heads_per_order: int
    eos: int


class NgramInjectInputs(NamedTuple):
    """One decode step's injection inputs (``conv_state`` updated in place; ``conv_weight [hc*H, K]``)."""

    hyper: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    norm_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # key, query, conv
    conv_weight: torch.Tensor
    conv_state: torch.Tensor
    slots: torch.Tensor
    fresh: torch.Tensor
    streams: int
    dilation: int
    eps: float


def write_live_rows(state: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``state[slots[i]] = rows[i]`` for every row with a slot ``>= 0``, without reading which rows those are on
    the host: a padding row rewrites the first live row's entry with that row's own value (or, with no live row,
    entry 0 with itself), so duplicate targets always carry equal values."""
    live = slots >= 0
    first = torch.argmax(live.to(torch.int32))
    source = torch.where(live, torch.arange(slots.shape[0], device=slots.device), first)
    target = slots[source].long().clamp_min(0)
    keep_new = live[source].view(-1, *([1] * (rows.dim() - 1)))
    state.index_copy_(0, target, torch.where(keep_new, rows[source].to(state.dtype), state[target]))


def _fresh(slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    return (fresh != 0) | (slots < 0)


def ngram_rows_ref(step: NgramRowsInputs) -> torch.Tensor:
    tokens, context, slots, fresh, multipliers, sizes, offsets, per_order, eos = step
    keep = context.shape[1]
    fresh = _fresh(slots, fresh)
    previous = torch.where(fresh[:, None], eos, context[slots.long().clamp_min(0)])
    history = torch.cat([previous, tokens[:, None].to(context.dtype)], dim=1)  # [T, n], oldest first
    back = history.flip(1)  # [T, n]: column s is the token s back
    # column s is cut when an EOS lies in columns 1 .. s-1
    cut = torch.zeros_like(back, dtype=torch.bool)
    if keep > 1:
        cut[:, 2:] = torch.cummax((back[:, 1:-1] == eos).to(torch.int8), dim=1).values.bool()
    products = torch.where(cut, eos, back) * multipliers
    mixed, ids = products[:, 0], []
    for order in range(2, keep + 2):
        mixed = torch.bitwise_xor(mixed, products[:, order - 1])
        heads = slice((order - 2) * per_order, (order - 1) * per_order)
        ids.append(torch.remainder(mixed[:, None], sizes[heads]) + offsets[heads])
    write_live_rows(context, slots, history[:, 1:])
    return torch.cat(ids, dim=1)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _ngram_rows_kernel(
    tokens_ptr,
    context_ptr,
    slots_ptr,
    fresh_ptr,
    mult_ptr,
    sizes_ptr,
    offsets_ptr,
    out_ptr,
    keep,
    heads,
    per_order,
    eos,
    BLOCK_N: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    fresh = (tl.load(fresh_ptr + row).to(tl.int32) != 0) | (slot < 0)
    token = tl.load(tokens_ptr + row).to(tl.int64)
    back = tl.arange(0, BLOCK_N)  # lane s: the token s back (lane 0: this one)
    stored = tl.load(
        context_ptr + slot * keep + keep - back, mask=(back >= 1) & (back <= keep) & ~fresh, other=eos
    )
    past = tl.where(back == 0, token, stored.to(tl.int64))
    # lane s is cut when an EOS sits in lanes 1 .. s-1
    between = (back[None, :] >= 1) & (back[None, :] < back[:, None]) & (past[None, :] == eos)
    cut = tl.max(between.to(tl.int32), axis=1) > 0
    products = tl.where(cut, eos, past) * tl.load(mult_ptr + back, mask=back <= keep, other=0)
    head = tl.arange(0, BLOCK_HEADS)
    order = 2 + head // per_order
    terms = tl.where(back[None, :] < order[:, None], products[None, :], 0)
    mixed = tl.reduce(terms, 1, _xor)
    head_mask = head < heads
    size = tl.load(sizes_ptr + head, mask=head_mask, other=1)
    offset = tl.load(offsets_ptr + head, mask=head_mask, other=0)
    tl.store(out_ptr + row * heads + head, mixed % size + offset, mask=head_mask)
    # the next context: the last keep tokens, oldest first (position i holds the token keep-1-i back)
    newest_back = keep - 1 - back
    kept = tl.max(tl.where(back[None, :] == newest_back[:, None], past[None, :], -1), axis=1)
    tl.store(context_ptr + slot * keep + back, kept, mask=(back < keep) & (slot >= 0))


def ngram_rows_triton(step: NgramRowsInputs) -> torch.Tensor:
    tokens, context, slots, fresh, multipliers, sizes, offsets, per_order, eos = step
    rows, keep, heads = tokens.shape[0], context.shape[1], sizes.shape[0]
    if not context.is_contiguous() or multipliers.shape != (keep + 1,) or heads != keep * per_order:
        raise ValueError(
            "ngram_rows needs a contiguous context [slots, n-1], n multipliers, (n-1)·per_order heads"
        )
    out = torch.empty(rows, heads, dtype=torch.int64, device=tokens.device)
    if rows:
        _ngram_rows_kernel[(rows,)](
            tokens,
            context,
            slots,
            fresh,
            multipliers,
            sizes,
            offsets,
            out,
            keep,
            heads,
            per_order,
            eos,
            BLOCK_N=next_pow2(keep + 1),
            BLOCK_HEADS=next_pow2(heads),
        )
    return out


def ngram_inject_ref(step: NgramInjectInputs) -> torch.Tensor:
    hyper, key, value, norms, conv_weight, conv_state, slots, fresh, streams, dilation, eps = step
    hidden, dtype = value.shape[-1], hyper.dtype
    key = grouped_norm_ref(key, norms[0], hidden, eps).unflatten(-1, (streams, hidden))
    query = grouped_norm_ref(hyper, norms[1], hidden, eps).unflatten(-1, (streams, hidden))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    gate = torch.sigmoid(gate.abs().clamp_min(1e-6).sqrt() * gate.sign())  # signed square root
    gated = (gate * value.unsqueeze(-2)).flatten(-2)
    normed = grouped_norm_ref(gated, norms[2], hidden, eps)
    fresh = _fresh(slots, fresh)
    history = conv_state[slots.long().clamp_min(0)].to(dtype).masked_fill(fresh[:, None, None], 0)
    padded = torch.cat([history, normed[:, None]], dim=1)  # [T, (K-1)·dilation + 1, hc*H]
    conv = torch.zeros(hyper.shape, dtype=torch.float32, device=hyper.device)
    for k in range(conv_weight.shape[1]):  # tap by tap, in fp32, as the per-sequence conv accumulates
        conv += padded[:, k * dilation].float() * conv_weight[:, k].float()
    write_live_rows(conv_state, slots, padded[:, 1:])
    return hyper + (gated + F.silu(conv.to(dtype)))


@triton.jit
def _zc_norm(x, w, hidden, eps):
    var = tl.sum(x * x, axis=0) / hidden
    return x * tl.rsqrt(var + eps) * (1.0 + w)


@triton.jit
def _ngram_inject_kernel(
    hyper_ptr,
    key_ptr,
    value_ptr,
    wk_ptr,
    wq_ptr,
    wc_ptr,
    conv_w_ptr,
    state_ptr,
    slots_ptr,
    fresh_ptr,
    out_ptr,
    hidden,
    h_tok,
    k_tok,
    v_tok,
    o_tok,
    s_slot,
    s_row,
    history,
    dilation,
    sqrt_hidden,
    eps,
    TAPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    stream = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    chan = stream * hidden + cols
    ty = out_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + row).to(tl.int64)
    fresh = (tl.load(fresh_ptr + row).to(tl.int32) != 0) | (slot < 0)
    x = tl.load(hyper_ptr + row * h_tok + chan, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(key_ptr + row * k_tok + chan, mask=mask, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + chan, mask=mask, other=0.0).to(tl.float32)
    wq = tl.load(wq_ptr + chan, mask=mask, other=0.0).to(tl.float32)
    k_hat = _zc_norm(k, wk, hidden, eps).to(ty).to(tl.float32)
    q_hat = _zc_norm(x, wq, hidden, eps).to(ty).to(tl.float32)
    dot = tl.sum((k_hat * q_hat).to(ty).to(tl.float32), axis=0).to(ty).to(tl.float32)
    score = (dot / sqrt_hidden).to(ty).to(tl.float32)
    root = tl.sqrt(tl.maximum(tl.abs(score), 1e-6).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    signed = tl.where(score > 0, root, tl.where(score < 0, -root, 0.0))
    gate = (1.0 / (1.0 + tl.exp(-signed))).to(ty).to(tl.float32)
    v = tl.load(value_ptr + row * v_tok + cols, mask=mask, other=0.0).to(tl.float32)
    gated = (gate * v).to(ty).to(tl.float32)
    wc = tl.load(wc_ptr + chan, mask=mask, other=0.0).to(tl.float32)
    c = _zc_norm(gated, wc, hidden, eps).to(ty).to(tl.float32)
    # the taps before this one come from the slot's history (zeros when fresh), read before it shifts
    state = state_ptr + slot * s_slot + chan
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for tap in range(TAPS - 1):
        past = tl.load(state + tap * dilation * s_row, mask=mask & ~fresh, other=0.0).to(ty).to(tl.float32)
        acc += past * tl.load(conv_w_ptr + chan * TAPS + tap, mask=mask, other=0.0).to(tl.float32)
    acc += c * tl.load(conv_w_ptr + chan * TAPS + TAPS - 1, mask=mask, other=0.0).to(tl.float32)
    conv = acc.to(ty).to(tl.float32)
    conv = (conv / (1.0 + tl.exp(-conv))).to(ty).to(tl.float32)
    added = (gated + conv).to(ty).to(tl.float32)
    tl.store(out_ptr + row * o_tok + chan, (x + added).to(ty), mask=mask)
    live = mask & (slot >= 0)
    for r in range(history - 1):
        older = tl.load(state + (r + 1) * s_row, mask=mask & ~fresh, other=0.0)
        tl.store(state + r * s_row, older, mask=live)
    tl.store(state + (history - 1) * s_row, c.to(state_ptr.dtype.element_ty), mask=live)


def ngram_inject_triton(step: NgramInjectInputs) -> torch.Tensor:
    hyper, key, value, norms, conv_weight, conv_state, slots, fresh, streams, dilation, eps = step
    rows, width = hyper.shape
    hidden, taps = width // streams, conv_weight.shape[1]
    history = conv_state.shape[1]
    if (
        key.shape != hyper.shape
        or value.shape != (rows, hidden)
        or history != (taps - 1) * dilation
        or not conv_weight.is_contiguous()
        or conv_state.stride(-1) != 1
        or any(t.stride(-1) != 1 for t in (hyper, key, value))
    ):
        raise ValueError(
            "ngram_inject needs hyper and key [T, hc*H], value [T, H] with contiguous rows, conv weight "
            "[hc*H, K] and a conv history of (K-1)·dilation rows"
        )
    out = torch.empty(rows, width, dtype=hyper.dtype, device=hyper.device)
    if rows:
        _ngram_inject_kernel[(rows, streams)](
            hyper,
            key,
            value,
            *norms,
            conv_weight,
            conv_state,
            slots,
            fresh,
            out,
            hidden,
            hyper.stride(0),
            key.stride(0),
            value.stride(0),
            out.stride(0),
            conv_state.stride(0),
            conv_state.stride(1),
            history,
            dilation,
            math.sqrt(hidden),
            eps,
            TAPS=taps,
            BLOCK=next_pow2(hidden),
        )
    return out


def ngram_rows(step: NgramRowsInputs) -> torch.Tensor:
    """Table row ids ``[T, heads]`` of a decode step (context updated); one Triton launch on CUDA."""
    fn = ngram_rows_triton if use_triton(step.tokens) else ngram_rows_ref
    return fn(step)


def ngram_inject(step: NgramInjectInputs) -> torch.Tensor:
    """``hyper + (gated + conv)`` of a decode step (conv history updated); one Triton launch on CUDA."""
    fn = ngram_inject_triton if use_triton(step.hyper) else ngram_inject_ref
    return fn(step)
