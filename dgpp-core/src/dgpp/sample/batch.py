"""One sampling call per step for the whole batch: the scheduler's sampler and the speculative verify's judge.

The batch's logits stay on their device. Rows whose choice has penalties, a logit bias or a grammar mask get
their row processed first (``ChoiceSampler.processed_logits``, in the sampler's order; a verify row also counts
the drafts ahead of it); then every row is drawn, and drafted rows judged, in one ``draw_and_judge`` call (greedy
rows as an argmax), and the chosen ids cross to the host in one copy. Only rows asking for logprobs do more work
afterwards, and only for the rows a caller reads. A seeded choice's ``k``-th sampled token uses a seed derived
from its stream and ``k`` (``ChoiceSampler.draw_params``), so it is reproducible however it is batched.

Judging point-mass drafts (``draw_and_judge``) runs for a whole verify step on the logits' device, with no
host sync. A verify row may carry a draft: the token the drafter put at the next position. Greedy rows keep it
when it is their argmax. Sampled rows run the ratio test for a point mass: keep the draft with the target's
probability of it, ``p(draft)`` over the row's kept set (temperature, top-k, min-p, top-p:
``dgpp.sample.draw.kept_set``); else draw from the residual ``(p - q)+`` normalised, which for a point mass
``q`` is ``p`` without the draft, by the same exponential race as a plain draw with the draft left out. Either
way the emitted token is distributed as plain sampling's. The acceptance uniform and the race's uniforms all
come from the row's draw seed (hashed at two ids past any vocabulary for the former, at the token ids for the
latter), so a row's verdict depends on its logits, its draft and its seed alone, never on its batch mates.
Rows without a draft draw as ``draw_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpp.kernels.sampling import _hash_u32_ref
from dgpp.sample.draw import RowParams, draw_tokens, group_of, kept_set
from dgpp.sample.sampler import ChoiceSampler, SampleResult

_U32 = 0xFFFFFFFF
# the acceptance uniform's two hash inputs: above every token id, so independent of the race's uniforms
_ACCEPT_HI, _ACCEPT_LO = _U32, _U32 - 1


@dataclass(frozen=True)
class Row:
    """One logits row to sample: its choice; for a verify row, whether it judges a draft (the draft itself is in
    ``sample_rows``' ``drafts``), how many of this step's drafts are ahead of it (its draw seed is that many
    places on) and, for a choice with penalties, those drafts (counted as emitted)."""

    choice: ChoiceSampler
    drafted: bool = False
    ahead: int = 0
    before: tuple[int, ...] = ()


class DrawnRows:
    """A step's drawn rows, on the host: ``tokens``, ``accepted`` (the row's draft was kept) and ``result(i)``."""

    def __init__(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        processed: torch.Tensor,
        failed: dict[int, Exception],
        drafts: torch.Tensor | None,
    ) -> None:
        self.rows, self._logits, self._processed, self._failed = rows, logits, processed, failed
        params = [RowParams(greedy=True) if i in failed else _params(r) for i, r in enumerate(rows)]
        tokens, accepted = draw_and_judge(processed, params, [r.drafted for r in rows], drafts)
        both = ids_to_host(
            torch.stack([tokens, accepted.to(torch.int64)])
        )  # the step's one device->host copy
        self.tokens: list[int] = both[0]
        self.accepted: list[bool] = [bool(a) for a in both[1]]

    def result(self, i: int) -> SampleResult | Exception:
        """Row ``i``'s result, or the exception its processing raised (a grammar failure ends that request alone)."""
        if i in self._failed:
            return self._failed[i]
        choice = self.rows[i].choice
        if choice.samples_alone:  # e.g. a forced prompt walk: its own token and raw logprobs
            return choice.sample(self._logits[i])
        return choice.result(self._processed[i], self.tokens[i])


def _params(row: Row) -> RowParams:
    return row.choice.draw_params(ahead=row.ahead)


def sample_rows(logits: torch.Tensor, rows: list[Row], drafts: torch.Tensor | None = None) -> DrawnRows:
    """Draw (and judge) every row of fp32 ``logits [R, V]``; ``drafts`` ``[R]`` int64 on the logits' device holds
    the drafted rows' drafts. Takes no draws from the choices (callers ``advance`` them by the tokens they keep)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} rows were given")
    failed: dict[int, Exception] = {}
    x = logits
    processed = [i for i, r in enumerate(rows) if r.choice.needs_processing]
    if processed:
        x = logits.clone()
        for i in processed:
            try:
                x[i] = rows[i].choice.processed_logits(logits[i], rows[i].before)
            except Exception as exc:  # noqa: BLE001 - reported per row, the others still sample
                failed[i] = exc
    return DrawnRows(rows, logits, x, failed, drafts)


def sample_batch(logits: torch.Tensor, choices: list[ChoiceSampler]) -> list[SampleResult | Exception]:
    """One result per row of fp32 ``logits [R, V]`` (one token per choice): the sample, or the exception that
    row's processing raised."""
    drawn = sample_rows(logits, [Row(c) for c in choices])
    results = [drawn.result(i) for i in range(len(choices))]
    for choice, result in zip(choices, results, strict=True):
        if not isinstance(result, Exception) and not choice.samples_alone:
            choice.advance(1)
    return results


def row_params(choice: ChoiceSampler) -> RowParams:
    """The draw's parameters for ``choice``'s next token, taking that draw (an overlapped step draws before the
    host reads the previous token)."""
    params = choice.draw_params()
    choice.advance(1)
    return params


def ids_to_host(ids: torch.Tensor) -> list:
    """The chosen ids as a list. On CUDA the wait for the step sleeps on an event with the GIL released (a
    ``tolist`` on a device tensor spins a core until the GPU is done), so the serving thread formats and sends
    the previous tokens while the GPU computes these."""
    return HostIds(ids).wait()


class HostIds:
    """A device->host copy of sampled ids queued now, read later: ``wait`` returns once the copy (and what the
    stream held before it) is done, not whatever was queued after it (an overlapped step, dgpp.sched.overlap)."""

    def __init__(self, ids: torch.Tensor) -> None:
        if ids.device.type != "cuda":
            self._ready: list | None = ids.tolist()
            return
        self._ready = None
        self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        self._host.copy_(ids, non_blocking=True)
        self._done = torch.cuda.Event(blocking=True)
        self._done.record(
            torch.cuda.current_stream(ids.device)
        )  # the ids' device (a tensor-parallel rank's own GPU)

    def wait(self) -> list:
        if self._ready is None:
            self._done.synchronize()
            self._ready = self._host.tolist()
        return self._ready


# ---- judging drafts ----------------------------------------------------------------------------


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
