"""Judging point-mass drafts for a whole verify step on the logits' device, with no host sync.

A verify row may carry a draft: the token the drafter put at the next position. Greedy rows keep it when it is
their argmax. Sampled rows run the ratio test for a point mass: keep the draft with the target's probability of
it, ``p(draft)`` over the row's kept set (temperature, top-k, min-p, top-p: ``dgpp.sample.draw.kept_set``); else
draw from the residual ``(p - q)+`` normalised, which for a point mass ``q`` is ``p`` without the draft, by the
same exponential race as a plain draw with the draft left out. Either way the emitted token is distributed as
plain sampling's. The acceptance uniform and the race's uniforms all come from the row's draw seed (hashed at
two ids past any vocabulary for the former, at the token ids for the latter), so a row's verdict depends on its
logits, its draft and its seed alone, never on its batch mates. Rows without a draft draw as ``draw_tokens``.
"""

from __future__ import annotations

import torch

from dgpp.kernels.sampling import _hash_u32_ref
from dgpp.sample.draw import RowParams, draw_tokens, group_of, kept_set

_U32 = 0xFFFFFFFF
# the acceptance uniform's two hash inputs: above every token id, so independent of the race's uniforms
_ACCEPT_HI, _ACCEPT_LO = _U32, _U32 - 1


def draw_and_judge(
    logits: torch.Tensor, rows: list[RowParams], drafted: list[bool], drafts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [R] int64, accepted [R] bool)`` on ``logits``' device for fp32 ``logits [R, V]`` (already
    penalised, biased, masked): each row's emitted token, and whether it is the row's draft. ``drafts`` ``[R]``
    int64 on the device holds each row's draft where ``drafted`` says it has one (None: no row has)."""
    n, vocab = logits.shape
    if not n == len(rows) == len(drafted):
        raise ValueError(f"logits has {n} rows for {len(rows)} row params and {len(drafted)} draft flags")
    device = logits.device
    judged = [i for i, (r, d) in enumerate(zip(rows, drafted, strict=True)) if d and not r.greedy]
    # sampled drafted rows are judged below; an argmax stands in for their plain draw
    stand_in = set(judged)
    plain = [RowParams(greedy=True) if i in stand_in else r for i, r in enumerate(rows)]
    tokens = draw_tokens(logits, plain)
    if drafts is None or not any(drafted):  # a plain step: nothing to judge
        return tokens, torch.zeros(n, dtype=torch.bool, device=device)
    has_draft = torch.tensor(drafted, dtype=torch.bool).to(device, non_blocking=True)
    accepted = (tokens == drafts) & has_draft  # greedy rows: the draft is their argmax
    groups: dict[str, list[int]] = {}
    for i in judged:
        groups.setdefault(group_of(rows[i], vocab), []).append(i)
    for name, idx in groups.items():
        index = torch.tensor(idx, dtype=torch.int64).to(device, non_blocking=True)
        token, took = _ratio_test(name, logits.index_select(0, index), [rows[i] for i in idx], drafts[index])
        tokens.index_copy_(0, index, token)
        accepted.index_copy_(0, index, took)
    return tokens, accepted


def _ratio_test(
    name: str, x: torch.Tensor, rows: list[RowParams], draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    kept = kept_set(name, x, rows)
    is_draft = kept.token_ids() == draft[:, None]
    mass = torch.where(kept.keep, torch.exp(kept.z.double()), 0.0)
    p_draft = (mass * is_draft).sum(-1) / mass.sum(-1)
    residual = _residual(kept.keep, is_draft)
    # nothing but the draft is kept: p(draft) is 1 (the uniform would take it too, short of rounding)
    took = (_accept_uniform(kept.seeds) < p_draft) | ~residual.any(-1)
    return torch.where(took, draft, kept.race(residual)), took


def _residual(keep: torch.Tensor, is_draft: torch.Tensor) -> torch.Tensor:
    """What a rejected row draws from: the kept set without the draft (the point mass's residual)."""
    return keep & ~is_draft


def _accept_uniform(seeds: torch.Tensor) -> torch.Tensor:
    """``[n]`` float64 uniforms in (0, 1) with 48 random bits, one per row seed."""
    seed32 = _hash_u32_ref((seeds ^ (seeds >> 32)) & _U32)
    hi = _hash_u32_ref(seed32 ^ _ACCEPT_HI) >> 8
    lo = _hash_u32_ref(seed32 ^ _ACCEPT_LO) >> 8
    return ((hi << 24) + lo).double().add(0.5).mul(2.0**-48)
