"""A MoE router's top-k from its logits in one pass: scores, the biased choice, the group limit, the top-k,
the weights.

``logits [T, E]`` -> ``(weights [T, k] in out_dtype, ids [T, k] int64)``: scores are ``softmax(logits)`` or
``sigmoid(logits)`` in fp32, or ``sqrt(softplus(logits))`` in the logits' dtype (DeepSeek-V4.1's fp32 logits,
DeepSeek-V4's bf16 ones: the softplus, the root and then the weights' sum, division and scale each rounded to
bf16, as the torch chain on bf16 tensors rounds them); the choice adds the correction bias (when given, fp32) to
the scores. With ``n_group > 1`` (DeepSeek-V3 / GLM-4.5 style group-limited
routing) the ``E`` experts form ``n_group`` equal groups of consecutive experts, each group is scored by the sum
of its two best choices when a bias is given (else by its best choice), and only the ``topk_group`` best groups
stay eligible. The ``k`` best eligible choices are taken in descending order; the weights are the picked scores,
divided by their sum (+1e-20) when ``renormalize``, times ``scale``, rounded to ``out_dtype`` once. Every ranking
(the groups, the experts) takes the lowest index first among equal values, in the torch reference as in the
kernel, so both pick the same experts in the same order.

One program per token row replaces the torch chain's scores, bias add, group top-2, group top-k, mask, top-k,
gather, sum, divide, scale and cast: 9 ops of a sigmoid router with a bias, 10 of a sqrt-softplus one, 17 grouped
(as ``dgpp.bench.launches`` counts them on the CUDA branch). ``hash_table [V, k]`` and ``token_ids [T]`` given
(DeepSeek-V4's hash layers): the experts are ``hash_table[token_ids]``, read in the kernel, and only the weights
are computed from the scores (the lookup, scores, gather, sum, divide and scale: 9 ops -> 1). A row reads only its own logits, so its result does
not depend on the other rows of the step; nothing is read back on the host. The exp, log, root and weight sum
are Triton's, so the weights can differ from the torch chain's in the last place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.torch_fp32_math import round_to_bf16

MAX_EXPERTS = 1024  # one program holds a token's whole row
KERNEL_SQRT_SOFTPLUS_DTYPES = (torch.float32, torch.bfloat16)  # the logits whose rounding the kernel repeats


class RouterTopKInputs(NamedTuple):
    """One router call's inputs, as the module docstring names them (``n_group == 1``: no group limit)."""

    logits: torch.Tensor
    bias: torch.Tensor | None
    top_k: int
    scoring: str  # "softmax", "sigmoid" or "sqrtsoftplus"
    renormalize: bool
    scale: float
    out_dtype: torch.dtype
    n_group: int = 1
    topk_group: int = 1
    hash_table: torch.Tensor | None = None  # [V, top_k] expert ids by token id: no selection
    token_ids: torch.Tensor | None = None  # [T], with hash_table


def top_k_lowest_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of each row's ``k`` largest ``values`` in descending order, the lowest index first among equal
    values (``torch.topk`` leaves the order of equal values unspecified)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def top_groups_mask(choice: torch.Tensor, n_group: int, topk_group: int, pair_sum: bool) -> torch.Tensor:
    """``[T, E]`` bool: the experts of each row's ``topk_group`` best groups; a group's score is the sum of
    its two best choices (``pair_sum``) or its best choice."""
    grouped = choice.view(choice.shape[0], n_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if pair_sum else grouped.max(dim=-1).values
    best = top_k_lowest_first(group_scores, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep[:, :, None].expand_as(grouped).reshape(choice.shape)


def pick_experts(
    choice: torch.Tensor, top_k: int, n_group: int, topk_group: int, pair_sum: bool
) -> torch.Tensor:
    """``[T, k]`` expert ids: each row's ``top_k`` best ``choice`` values within its best groups."""
    if n_group > 1:
        choice = choice.masked_fill(~top_groups_mask(choice, n_group, topk_group, pair_sum), float("-inf"))
    return top_k_lowest_first(choice, top_k)


SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")  # the kernel's SCORING is the index


def router_scores_ref(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Softmax / sigmoid in fp32, sqrt-softplus in the logits' dtype."""
    if scoring == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits.float())
    return torch.nn.functional.softplus(logits).sqrt()


def router_topk_ref(step: RouterTopKInputs) -> tuple[torch.Tensor, torch.Tensor]:
    logits, bias, top_k, scoring, renormalize, scale, out_dtype, n_group, topk_group, table, tokens = step
    scores = router_scores_ref(logits, scoring)
    if table is not None and tokens is not None:
        ids = table[tokens.long()]
    else:
        choice = scores.float() + bias.float() if bias is not None else scores.float()
        ids = pick_experts(choice, top_k, n_group, topk_group, pair_sum=bias is not None)
    weights = scores.gather(1, ids)  # in the scores' dtype from here on
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return (weights * scale).to(out_dtype), ids


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    table_ptr,
    token_ptr,
    group_size,
    l_stride,
    scale,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_SCORES: tl.constexpr,
    HASHED: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # the row as a [group, expert in group] tile: expert e = group * group_size + slot
    tok = tl.program_id(0).to(tl.int64)
    grp = tl.arange(0, BLOCK_G)
    slot = tl.arange(0, BLOCK_S)[None, :]
    e = grp[:, None] * group_size + slot
    live = (grp[:, None] < N_GROUP) & (slot < group_size)
    x = tl.load(logits_ptr + tok * l_stride + e, mask=live, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        p = tl.where(live, tl.exp(x - tl.max(tl.max(x, axis=1), axis=0)), 0.0)
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:  # softplus as torch's (x itself above 20), log1p(y) as log(1 + y) * y / ((1 + y) - 1) to keep small y
        y = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
        soft = tl.where(x > 20.0, x, log1p)
        if ROUND_SCORES:  # the chain's bf16 softplus, then its bf16 root
            soft = round_to_bf16(soft)
        scores = tl.sqrt_rn(soft)
        if ROUND_SCORES:
            scores = round_to_bf16(scores)
    kk = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], tl.float32)
    if HASHED:  # the token's experts from the table; only their weights are computed
        tid = tl.load(token_ptr + tok).to(tl.int64)
        for k in tl.static_range(TOP_K):
            idx = tl.load(table_ptr + tid * TOP_K + k).to(tl.int64)
            tl.store(ids_ptr + tok * TOP_K + k, idx)
            picked = tl.where(
                kk == k, tl.sum(tl.sum(tl.where(e == idx, scores, 0.0), axis=1), axis=0), picked
            )
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=live, other=0.0).to(tl.float32)
    choice = tl.where(live, choice, float("-inf"))
    if N_GROUP > 1:
        group_score = tl.max(choice, axis=1)
        if HAS_BIAS:  # plus the group's second best: its best slot masked once
            first = tl.min(tl.where(choice == group_score[:, None], slot, BLOCK_S), axis=1)
            group_score += tl.max(tl.where(slot == first[:, None], float("-inf"), choice), axis=1)
        group_score = tl.where(grp < N_GROUP, group_score, float("-inf"))
        keep = grp < 0
        for _ in tl.static_range(TOPK_GROUP):
            best_group = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == best_group, grp, BLOCK_G), axis=0)  # the lowest group
            keep = keep | (grp == pick)
            group_score = tl.where(grp == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    for k in tl.static_range(0 if HASHED else TOP_K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(choice == best, e, BLOCK_G * BLOCK_S), axis=1), axis=0)  # lowest expert
        tl.store(ids_ptr + tok * TOP_K + k, idx.to(tl.int64))
        at = e == idx
        picked = tl.where(kk == k, tl.sum(tl.sum(tl.where(at, scores, 0.0), axis=1), axis=0), picked)
        choice = tl.where(at, float("-inf"), choice)
    if RENORMALIZE and ROUND_SCORES:  # the bf16 chain: sum, + 1e-20, quotient and product each rounded
        total = round_to_bf16(round_to_bf16(tl.sum(picked, axis=0)) + 1e-20)
        picked = round_to_bf16(picked / total)
    elif RENORMALIZE:
        picked = picked / (tl.sum(picked, axis=0) + 1e-20)
    out = picked * scale
    if ROUND_SCORES:
        out = round_to_bf16(out)
    out = out.to(weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + tok * TOP_K + kk, out, mask=kk < TOP_K)


def _check(step: RouterTopKInputs) -> int:
    """The group size of ``step``, or a ValueError naming what the kernel cannot take."""
    num_experts = step.logits.shape[1]
    if step.scoring not in SCORINGS:
        raise ValueError(f"router_topk: scoring {step.scoring!r} is not one of {SCORINGS}")
    if step.scoring == "sqrtsoftplus" and step.logits.dtype not in KERNEL_SQRT_SOFTPLUS_DTYPES:
        raise ValueError(f"router_topk scores sqrt-softplus on fp32 or bf16 logits, got {step.logits.dtype}")
    if num_experts > MAX_EXPERTS or step.logits.stride(-1) != 1:
        raise ValueError(f"router_topk takes up to {MAX_EXPERTS} experts in contiguous rows")
    if step.n_group < 1 or num_experts % step.n_group or not 1 <= step.topk_group <= step.n_group:
        raise ValueError(
            f"router_topk: n_group={step.n_group} / topk_group={step.topk_group} do not split "
            f"{num_experts} experts into groups"
        )
    table, token_ids = step.hash_table, step.token_ids
    if (table is None) != (token_ids is None):
        raise ValueError("router_topk: hash_table and token_ids go together")
    if table is not None and token_ids is not None:
        if table.dim() != 2 or table.shape[1] != step.top_k or not table.is_contiguous():
            raise ValueError(f"router_topk: hash_table must be a contiguous [vocab, {step.top_k}] table")
        if token_ids.shape != step.logits.shape[:1]:
            raise ValueError(f"router_topk: {step.logits.shape[0]} rows need as many token_ids")
    group_size = num_experts // step.n_group
    if step.n_group > 1 and step.bias is not None and group_size < 2:
        raise ValueError("router_topk: a group scored by its two best experts needs >= 2 experts per group")
    if step.top_k > step.topk_group * group_size:
        raise ValueError(
            f"router_topk: top_k={step.top_k} exceeds the {step.topk_group * group_size} eligible experts"
        )
    return group_size


def router_topk_triton(step: RouterTopKInputs) -> tuple[torch.Tensor, torch.Tensor]:
    logits, bias, top_k, scoring, renormalize, scale, out_dtype, n_group, topk_group, table, token_ids = step
    group_size = _check(step)
    tokens = logits.shape[0]
    weights = torch.empty(tokens, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _router_topk_kernel[(tokens,)](
            logits,
            bias if bias is not None else logits,
            weights,
            ids,
            table if table is not None else ids,
            token_ids if token_ids is not None else ids,
            group_size,
            logits.stride(0),
            float(scale),
            TOP_K=top_k,
            SCORING=SCORINGS.index(scoring),
            HAS_BIAS=bias is not None,
            RENORMALIZE=renormalize,
            ROUND_SCORES=scoring == "sqrtsoftplus" and logits.dtype == torch.bfloat16,
            HASHED=table is not None,
            N_GROUP=n_group,
            TOPK_GROUP=topk_group,
            BLOCK_G=next_pow2(n_group),
            BLOCK_S=next_pow2(group_size),
            BLOCK_K=next_pow2(top_k),
            num_warps=4,
        )
    return weights, ids


def router_topk(step: RouterTopKInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` of the top-k experts; one Triton launch on CUDA, torch elsewhere."""
    fn = router_topk_triton if use_triton(step.logits) else router_topk_ref
    return fn(step)
