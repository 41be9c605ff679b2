"""A MoE router's top-k from its logits in one pass: scores, the biased choice, the top-k, the weights.

``logits [T, E]`` (fp32) -> ``(weights [T, k] in out_dtype, ids [T, k] int64)``: scores are
``softmax(logits)`` or ``sigmoid(logits)`` in fp32; the choice adds the correction bias (when given) to the
scores; the ``k`` best choices are taken in descending order (the lowest expert first among equal choices);
the weights are the picked scores, divided by their sum (+1e-20) when ``renormalize``, times ``scale``, rounded
to ``out_dtype`` once. One program per token replaces the chain's scores, bias add, top-k, gather, sum, divide,
scale and cast (eight launches or more). The exp and the weight sum are Triton's, so the weights can differ
from the torch chain's in the last place; on ties of the choice the chain's top-k order is torch's own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton

MAX_EXPERTS = 1024  # one program holds a token's whole row


class RouterTopKInputs(NamedTuple):
    """One router call's inputs, as the module docstring names them."""

    logits: torch.Tensor
    bias: torch.Tensor | None
    top_k: int
    softmax: bool
    renormalize: bool
    scale: float
    out_dtype: torch.dtype


def router_topk_ref(step: RouterTopKInputs) -> tuple[torch.Tensor, torch.Tensor]:
    logits, bias, top_k, softmax, renormalize, scale, out_dtype = step
    scores = torch.softmax(logits.float(), dim=-1) if softmax else torch.sigmoid(logits.float())
    choice = scores + bias.float() if bias is not None else scores
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return (weights * scale).to(out_dtype), ids


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    l_stride,
    scale,
    TOP_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    live = e < num_experts
    x = tl.load(logits_ptr + tok * l_stride + e, mask=live, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        p = tl.where(live, tl.exp(x - tl.max(x, axis=0)), 0.0)
        scores = p / tl.sum(p, axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=live, other=0.0).to(tl.float32)
    choice = tl.where(live, choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, e, BLOCK_E), axis=0)  # the lowest expert among equals
        tl.store(ids_ptr + tok * TOP_K + k, idx.to(tl.int64))
        picked = tl.where(kk == k, tl.sum(tl.where(e == idx, scores, 0.0), axis=0), picked)
        choice = tl.where(e == idx, float("-inf"), choice)
    if RENORMALIZE:
        picked = picked / (tl.sum(picked, axis=0) + 1e-20)
    out = (picked * scale).to(weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + tok * TOP_K + kk, out, mask=kk < TOP_K)


def router_topk_triton(step: RouterTopKInputs) -> tuple[torch.Tensor, torch.Tensor]:
    logits, bias, top_k, softmax, renormalize, scale, out_dtype = step
    tokens, num_experts = logits.shape
    if num_experts > MAX_EXPERTS or logits.stride(-1) != 1:
        raise ValueError(f"router_topk takes up to {MAX_EXPERTS} experts in contiguous rows")
    weights = torch.empty(tokens, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _router_topk_kernel[(tokens,)](
            logits,
            bias if bias is not None else logits,
            weights,
            ids,
            num_experts,
            logits.stride(0),
            float(scale),
            TOP_K=top_k,
            SOFTMAX=softmax,
            HAS_BIAS=bias is not None,
            RENORMALIZE=renormalize,
            BLOCK_E=next_pow2(num_experts),
            BLOCK_K=next_pow2(top_k),
            num_warps=4,
        )
    return weights, ids


def router_topk(step: RouterTopKInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` of the top-k experts; one Triton launch on CUDA, torch elsewhere."""
    fn = router_topk_triton if use_triton(step.logits) else router_topk_ref
    return fn(step)
