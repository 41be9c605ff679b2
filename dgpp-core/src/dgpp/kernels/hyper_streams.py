"""A multi-stream residual's glue in two passes: the per-stream norm (with the previous block's injection), and
the gated mix of the normed streams into one block input.

The residual is ``hc`` streams of ``H`` features held flat as ``hyper [T, hc*H]`` (stream major).

- ``stream_norm``: optionally first ``hyper += block_out · 2σ(logits / hc)`` per stream (``block_out [T, H]``,
  ``logits [T, hc]``: the block's injection logits), then every stream's zero-centred RMSNorm ``x̂ · (1 + w)``
  (``weight [hc*H]``, one row per stream). Returns ``(normed, hyper)``, both ``[T, hc*H]``.
- ``stream_mix``: ``mean_s σ(up_s · silu(low / hc)) ⊙ normed_s`` -> ``[T, H]``, where ``low [T, r]`` is the
  low-rank bottleneck's input (the ``down`` projection of ``normed``) and ``up [hc*H, r]`` its expansion; the
  expansion's product is taken in the kernel, so the ``[T, hc*H]`` weights never reach memory.

Rounding points are the torch chain's: each elementwise result rounded to the activation dtype, the norm and the
dot products taken in fp32. One program per (token, stream) row for the norm. The mix is a product
``gate @ up^T`` per stream, so it runs in (16-token, 16-column) tiles whose expansion weights are read once for
the tile's tokens (one program per token re-read the whole ``[hc*H, r]`` weight for every token of an 8K
prompt).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton

# the mix's tile, the same for every token count (so a token's logits are one chain of MMA steps over the padded
# bottleneck alone or among 8K): 16 tokens by 16 columns of H (a 2,560-wide row spreads over 160 programs a
# token tile), the streams' up tiles three loads deep
_MIX_TOKENS = 16
_MIX_COLUMNS = 16
_MIX_WARPS = 4
_MIX_STAGES = 3


class StreamNormInputs(NamedTuple):
    """One ``stream_norm`` call (``block_out`` and ``logits`` both None: no injection)."""

    hyper: torch.Tensor
    weight: torch.Tensor
    eps: float
    streams: int
    block_out: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class StreamMixInputs(NamedTuple):
    """One ``stream_mix`` call (``low`` may be a column slice of a wider projection output)."""

    normed: torch.Tensor
    low: torch.Tensor
    up_weight: torch.Tensor
    streams: int


def inject_ref(
    hyper: torch.Tensor, block_out: torch.Tensor, logits: torch.Tensor, streams: int
) -> torch.Tensor:
    """``stream_i += 2σ(logits_i / hc) · block_out`` for every stream."""
    inject = 2 * torch.sigmoid(logits / streams)
    return hyper + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)


def grouped_norm_ref(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of each ``group``-wide slice of the last dim, in fp32, rounded once."""
    grouped = x.float().unflatten(-1, (-1, group))
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def stream_norm_ref(step: StreamNormInputs) -> tuple[torch.Tensor, torch.Tensor]:
    hyper, weight, eps, streams, block_out, logits = step
    if block_out is not None and logits is not None:
        hyper = inject_ref(hyper, block_out, logits, streams)
    return grouped_norm_ref(hyper, weight, hyper.shape[-1] // streams, eps), hyper


def stream_mix_ref(step: StreamMixInputs) -> torch.Tensor:
    normed, low, up_weight, streams = step
    weights = torch.sigmoid(F.linear(F.silu(low / streams), up_weight))
    return (weights * normed).unflatten(-1, (streams, -1)).mean(dim=-2)


@triton.jit
def _stream_norm_kernel(
    hyper_ptr,
    w_ptr,
    out_ptr,
    normed_ptr,
    block_ptr,
    logit_ptr,
    hidden,
    h_tok,
    o_tok,
    n_tok,
    b_tok,
    l_tok,
    streams,
    eps,
    INJECT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    stream = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    ty = normed_ptr.dtype.element_ty
    x = tl.load(hyper_ptr + tok * h_tok + stream * hidden + cols, mask=mask, other=0.0)
    if INJECT:
        logit = tl.load(logit_ptr + tok * l_tok + stream).to(tl.float32)
        scaled = (logit / streams).to(ty).to(tl.float32)
        inject = 2.0 * (1.0 / (1.0 + tl.exp(-scaled))).to(ty).to(tl.float32)  # x2 is exact
        out = tl.load(block_ptr + tok * b_tok + cols, mask=mask, other=0.0).to(tl.float32)
        added = (out * inject).to(ty).to(tl.float32)
        x = (x.to(tl.float32) + added).to(ty)
        tl.store(out_ptr + tok * o_tok + stream * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    w = tl.load(w_ptr + stream * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    normed = xf * tl.rsqrt(var + eps) * (1.0 + w)
    tl.store(normed_ptr + tok * n_tok + stream * hidden + cols, normed.to(ty), mask=mask)


def stream_norm_triton(step: StreamNormInputs) -> tuple[torch.Tensor, torch.Tensor]:
    hyper, weight, eps, streams, block_out, logits = step
    tokens, width = hyper.shape
    hidden = width // streams
    inject = block_out is not None and logits is not None
    if width != streams * hidden or hyper.stride(-1) != 1 or weight.shape != (width,):
        raise ValueError("stream_norm needs hyper [T, hc*H] with contiguous rows and a weight [hc*H]")
    if inject and (block_out.shape != (tokens, hidden) or logits.shape != (tokens, streams)):
        raise ValueError("stream_norm's injection needs block_out [T, H] and logits [T, hc]")
    normed = torch.empty(tokens, width, dtype=hyper.dtype, device=hyper.device)
    out = torch.empty_like(normed) if inject else hyper
    block_out = block_out.contiguous() if inject else hyper
    logits = logits if inject else hyper
    if tokens:
        _stream_norm_kernel[(tokens, streams)](
            hyper,
            weight,
            out,
            normed,
            block_out,
            logits,
            hidden,
            hyper.stride(0),
            out.stride(0),
            normed.stride(0),
            block_out.stride(0),
            logits.stride(0),
            streams,
            eps,
            INJECT=inject,
            BLOCK=next_pow2(hidden),
        )
    return normed, out


@triton.jit(do_not_specialize=["tokens"])
def _stream_mix_kernel(
    normed_ptr,
    low_ptr,
    up_ptr,
    out_ptr,
    tokens,
    hidden,
    rank,
    n_tok,
    l_tok,
    o_tok,
    STREAMS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A ``[BLOCK_T tokens, BLOCK_H columns]`` tile: the tokens' gates once, then per stream (a loop whose next
    up tile loads while this one multiplies) one product over the whole padded bottleneck."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ranks = tl.arange(0, BLOCK_R)
    tok_mask = toks < tokens
    col_mask = cols < hidden
    rank_mask = ranks < rank
    cell_mask = tok_mask[:, None] & col_mask[None, :]
    ty = out_ptr.dtype.element_ty
    low = tl.load(
        low_ptr + toks[:, None].to(tl.int64) * l_tok + ranks[None, :],
        mask=tok_mask[:, None] & rank_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    low = (low / STREAMS).to(ty).to(tl.float32)
    gates = (low * (1.0 / (1.0 + tl.exp(-low)))).to(ty)  # [BLOCK_T, BLOCK_R]; silu(0) = 0 past the rank
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for stream in range(STREAMS):
        rows = stream * hidden + cols
        up = tl.load(
            up_ptr + rows[None, :].to(tl.int64) * rank + ranks[:, None],
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_H]
        logit = tl.dot(gates, up, input_precision=PRECISION).to(ty).to(tl.float32)
        weight = (1.0 / (1.0 + tl.exp(-logit))).to(ty).to(tl.float32)
        x = tl.load(
            normed_ptr + toks[:, None].to(tl.int64) * n_tok + rows[None, :], mask=cell_mask, other=0.0
        ).to(tl.float32)
        acc += (weight * x).to(ty).to(tl.float32)
    tl.store(
        out_ptr + toks[:, None].to(tl.int64) * o_tok + cols[None, :], (acc / STREAMS).to(ty), mask=cell_mask
    )


def stream_mix_triton(step: StreamMixInputs) -> torch.Tensor:
    normed, low, up_weight, streams = step
    tokens, width = normed.shape
    hidden, rank = width // streams, low.shape[-1]
    if (
        up_weight.shape != (width, rank)
        or not up_weight.is_contiguous()
        or up_weight.dtype != normed.dtype
        or normed.stride(-1) != 1
        or low.stride(-1) != 1
    ):
        raise ValueError(
            "stream_mix needs normed [T, hc*H], low [T, r] with contiguous rows, up [hc*H, r] of normed's dtype"
        )
    out = torch.empty(tokens, hidden, dtype=normed.dtype, device=normed.device)
    if tokens:
        grid = (triton.cdiv(tokens, _MIX_TOKENS), triton.cdiv(hidden, _MIX_COLUMNS))
        _stream_mix_kernel[grid](
            normed,
            low,
            up_weight,
            out,
            tokens,
            hidden,
            rank,
            normed.stride(0),
            low.stride(0),
            out.stride(0),
            STREAMS=streams,
            BLOCK_T=_MIX_TOKENS,
            BLOCK_H=_MIX_COLUMNS,
            BLOCK_R=max(16, next_pow2(rank)),
            PRECISION="ieee" if normed.dtype == torch.float32 else "tf32",
            num_warps=_MIX_WARPS,
            num_stages=_MIX_STAGES,
        )
    return out


def stream_norm(step: StreamNormInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, hyper)`` (the injection applied first when given); one Triton launch on CUDA, torch elsewhere."""
    fn = stream_norm_triton if use_triton(step.hyper) else stream_norm_ref
    return fn(step)


def stream_mix(step: StreamMixInputs) -> torch.Tensor:
    """The gated mean of the normed streams ``[T, H]``; one Triton launch on CUDA, torch elsewhere."""
    fn = stream_mix_triton if use_triton(step.normed) else stream_mix_ref
    return fn(step)
