"""One sampling call per step for the whole batch: the scheduler's sampler and the speculative verify's judge.

The batch's logits stay on their device. Rows whose choice has penalties, a logit bias or a grammar mask get
their row processed first (``ChoiceSampler.processed_logits``, in the sampler's order; a verify row also counts
the drafts ahead of it); then every row is drawn, and drafted rows judged, in one ``draw_and_judge`` call (greedy
rows as an argmax), and the chosen ids cross to the host in one copy. Only rows asking for logprobs do more work
afterwards, and only for the rows a caller reads. A seeded choice's ``k``-th sampled token uses a seed derived
from its stream and ``k`` (``ChoiceSampler.draw_params``), so it is reproducible however it is batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpp.sample.draw import RowParams
from dgpp.sample.sampler import ChoiceSampler, SampleResult
from dgpp.sample.verify import draw_and_judge


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
