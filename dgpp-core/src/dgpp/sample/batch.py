"""One sampling call per step for the whole batch: the scheduler's sampler.

The batch's logits stay on their device. Rows whose choice has penalties, a logit bias or a grammar mask get
their row processed first (``ChoiceSampler.processed_logits``, in the sampler's order); then every row is drawn
in one ``draw_tokens`` call (greedy rows as an argmax), and the chosen ids cross to the host in one copy. Only
rows asking for logprobs do more work afterwards. A seeded choice's ``k``-th draw uses a seed derived from its
stream and ``k`` (``ChoiceSampler.next_draw_seed``), so it is reproducible however it is batched.
"""

from __future__ import annotations

import torch

from dgpp.sample.draw import RowParams, draw_tokens
from dgpp.sample.sampler import ChoiceSampler, SampleResult, filtered_distribution, result_with_logprobs


def row_params(choice: ChoiceSampler) -> RowParams:
    """The draw's parameters for ``choice``'s next token (takes a draw seed when it samples)."""
    p = choice.params
    if p.greedy:
        return RowParams(greedy=True)
    return RowParams(False, p.temperature, p.top_k, p.min_p, p.top_p, choice.next_draw_seed())


def sample_batch(logits: torch.Tensor, choices: list[ChoiceSampler]) -> list[SampleResult | Exception]:
    """One result per row of fp32 ``logits [R, V]``: the sample, or the exception that row's processing raised
    (a grammar failure ends that request alone)."""
    if logits.shape[0] != len(choices):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(choices)} choices were given")
    failed: dict[int, Exception] = {}
    x = logits
    processed = [i for i, c in enumerate(choices) if c.needs_processing]
    if processed:
        x = logits.clone()
        for i in processed:
            try:
                row = choices[i].processed_logits(logits[i])
                if choices[i].mask_fn is not None and not bool(torch.isfinite(row).any()):
                    raise ValueError("every token is masked: nothing can be sampled")
                x[i] = row
            except Exception as exc:  # noqa: BLE001 - reported per row, the others still sample
                failed[i] = exc
    rows = [RowParams(greedy=True) if i in failed else row_params(c) for i, c in enumerate(choices)]
    tokens = ids_to_host(draw_tokens(x, rows))  # the step's one device->host copy
    results: list[SampleResult | Exception] = []
    for i, (token, choice) in enumerate(zip(tokens, choices, strict=True)):
        if i in failed:
            results.append(failed[i])
        elif choice.samples_alone:  # e.g. a forced prompt walk: its own token and raw logprobs
            results.append(choice.sample(logits[i]))
        elif choice.params.logprobs:
            results.append(_with_logprobs(x[i], int(token), choice))
        else:
            results.append(SampleResult(token=int(token)))
    return results


def ids_to_host(ids: torch.Tensor) -> list[int]:
    """The chosen ids as a list. On CUDA the wait for the step sleeps on an event with the GIL released (a
    ``tolist`` on a device tensor spins a core until the GPU is done), so the serving thread formats and sends
    the previous tokens while the GPU computes these."""
    return HostIds(ids).wait()


class HostIds:
    """A device->host copy of sampled ids queued now, read later: ``wait`` returns once the copy (and what the
    stream held before it) is done, not whatever was queued after it (an overlapped step, dgpp.sched.overlap)."""

    def __init__(self, ids: torch.Tensor) -> None:
        if ids.device.type != "cuda":
            self._ready: list[int] | None = ids.tolist()
            return
        self._ready = None
        self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        self._host.copy_(ids, non_blocking=True)
        self._done = torch.cuda.Event(blocking=True)
        self._done.record(
            torch.cuda.current_stream(ids.device)
        )  # the ids' device (a tensor-parallel rank's own GPU)

    def wait(self) -> list[int]:
        if self._ready is None:
            self._done.synchronize()
            self._ready = self._host.tolist()
        return self._ready


def _with_logprobs(row: torch.Tensor, token: int, choice: ChoiceSampler) -> SampleResult:
    """What the reference sampler reports: the raw distribution for greedy rows, the filtered and renormalized
    one for sampled rows."""
    p = choice.params
    if p.greedy:
        logprobs = torch.log_softmax(row, dim=0)
    else:
        ids, probs = filtered_distribution(row, p)
        logprobs = torch.full_like(row, float("-inf"))
        logprobs[ids] = torch.log(probs / probs.sum())
    return result_with_logprobs(token, logprobs, p.top_logprobs)
