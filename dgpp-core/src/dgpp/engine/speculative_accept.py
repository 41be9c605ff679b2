"""Judging one verify row against its draft token.

Greedy requests take the target's own greedy pick and keep the draft only when it equals it, so the
transcript is the plain greedy one. Sampled requests run the ratio test for a greedy (point-mass) draft:
accept the draft with the target's probability ``p(draft)``; on rejection draw from the normalised residual
``(p - q)+``, which for a point mass is ``p`` with the draft's mass removed. Both draws come from the choice's
own seeded generator, so a seeded request is reproducible run to run.
"""

from __future__ import annotations

import torch

from dgpp.sample.rng import uniform
from dgpp.sample.sampler import ChoiceSampler, SampleResult, filtered_distribution, result_with_logprobs


def judge_row(sampler: ChoiceSampler, logits: torch.Tensor, draft: int | None) -> tuple[SampleResult, bool]:
    """The token this row emits and whether it is ``draft``. ``draft`` None (the bonus row) samples plainly."""
    if draft is None or sampler.params.greedy:
        result = sampler.sample(logits)
        return result, draft is not None and result.token == draft
    return _ratio_test(sampler, logits, draft)


def _ratio_test(sampler: ChoiceSampler, logits: torch.Tensor, draft: int) -> tuple[SampleResult, bool]:
    params = sampler.params
    ids, probs = filtered_distribution(sampler.processed_logits(logits), params)
    probs = (probs / probs.sum()).to(torch.float64)
    at_draft = ids == draft
    p_draft = float(probs[at_draft].sum())
    if uniform(sampler.generator) < p_draft:
        token, accepted = draft, True
    else:
        residual = torch.where(at_draft, torch.zeros_like(probs), probs)
        cumulative = torch.cumsum(residual, dim=0)
        u = uniform(sampler.generator) * float(cumulative[-1])
        at = torch.tensor([u], dtype=torch.float64, device=cumulative.device)
        # a zero-mass id sits on a flat step of the cumulative sum, so searchsorted never lands on it
        pick = min(int(torch.searchsorted(cumulative, at, right=True)[0]), ids.shape[0] - 1)
        token, accepted = int(ids[pick]), False
    logprobs = None
    if params.logprobs:
        # reported as the plain sampler would: the target's filtered distribution, not the residual
        logprobs = torch.full((logits.shape[-1],), float("-inf"), dtype=torch.float32, device=logits.device)
        logprobs[ids] = torch.log(probs.float())
    return result_with_logprobs(token, logprobs, params.top_logprobs), accepted
