"""Overlapped decode steps: the next step is on the GPU before the host reads the current step's tokens.

Without overlap every decode step ends with the host waiting for the sampled ids, then emitting them, handing the
events out, building and staging the next work list and launching it, while the GPU idles (close to a tenth of
an 8B decode step at 64 rows; docs/benchmarks.md). Here a decode-only step whose rows need the batched
draw alone (no penalties, logit bias, grammar mask, logprobs or forced walk) is left in flight: its sampled ids stay
on the device (``InFlight``). The next tick launches the following step from those ids (``runner.step(works,
input_ids=ids)`` copies them into the step's inputs on the device) and only then waits for the first step's ids
and emits them, so that host work runs while the GPU computes. Every row computes what it computes without
overlap: same inputs, same kernels, same draw seeds, so greedy and seeded output are unchanged.

A row whose in-flight token is its last by length does not go on. A row that turns out to end on EOS has one
step computed and discarded: its KV write lands in its own reserved blocks at a position below its reservation,
queued on the device before the blocks are freed, and its state slot is zeroed by its next owner's first prefill,
which is queued later. Anything else a tick must do (admit, prefill, cancel, rows that need the host's logits)
first drains the step in flight, then runs the tick as without overlap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dgpp.engine.work import SeqWork
from dgpp.sample.batch import HostIds, row_params
from dgpp.sample.draw import draw_tokens
from dgpp.sample.sampler import SampleResult
from dgpp.sched.request import SeqStatus, Sequence


@dataclass
class InFlight:
    """A launched decode step whose sampled ids are still on the device."""

    seqs: list[Sequence]  # its rows, in order
    ids: torch.Tensor  # [len(seqs)] int64, the sampled ids
    host: HostIds  # their copy to the host, queued right behind the draw
    launched_at: float


def draw_alone(s: Sequence) -> bool:
    """The row's next token needs only the batched draw (nothing the host must do with its logits row)."""
    c = s.sampler
    return not (c.needs_processing or c.samples_alone or s.params.logprobs)


def goes_on(s: Sequence, max_position: int) -> bool:
    """``s`` decodes another step after its in-flight token (called before that token is emitted, with
    ``s.computed`` already counting the in-flight step): the emission's length checks, one token ahead."""
    return len(s.output) + 1 < s.params.max_tokens and s.computed + 1 < max_position


def chainable(step: InFlight, has_cancels: bool, has_waiting: bool) -> bool:
    """The next step may launch from ``step``'s ids: nothing for the tick to do but decode the same rows."""
    return not (has_cancels or has_waiting) and all(
        s.status is SeqStatus.FINISHED or (s.status is SeqStatus.DECODE and draw_alone(s)) for s in step.seqs
    )


def next_inputs(step: InFlight, max_position: int) -> tuple[list[Sequence], torch.Tensor]:
    """The rows of the step after ``step`` (still decoding, not at their length limit) and their input ids."""
    keep = [i for i, s in enumerate(step.seqs) if s.status is SeqStatus.DECODE and goes_on(s, max_position)]
    if len(keep) == len(step.seqs):
        return step.seqs, step.ids
    index = torch.tensor(keep, dtype=torch.int64).to(step.ids.device, non_blocking=True)
    return [step.seqs[i] for i in keep], step.ids.index_select(0, index)


class OverlapSteps:
    """The scheduler's overlapped decode steps (mixed into ``dgpp.sched.scheduler.Scheduler``, whose state they
    use: ``runner``, ``config``, ``stats``, ``waiting``, ``_cancels``, ``_emit``)."""

    overlap_steps: bool
    _inflight: InFlight | None
    runner: Any
    config: Any
    stats: Any
    speculative: Any
    waiting: Any
    _cancels: dict

    def _overlaps(self, decodes: list[Sequence]) -> bool:
        """Whether this decode-only step can be left in flight (the scheduler asks only with overlap on)."""
        return (
            self.speculative is None
            and self.config.admission != "grow"
            and all(draw_alone(s) for s in decodes)
            and any(goes_on(s, self.config.max_position - 1) for s in decodes)
        )

    def _launch(
        self, works: list[SeqWork], decodes: list[Sequence], input_ids: torch.Tensor | None = None
    ) -> None:
        """Put a decode step on the device and leave its sampled ids there (``self._inflight``)."""
        t0 = time.monotonic()
        logits = (
            self.runner.step(works) if input_ids is None else self.runner.step(works, input_ids=input_ids)
        )  # type: ignore[call-arg]
        self._flush_ready()
        ids = draw_tokens(logits, [row_params(s.sampler) for s in decodes])
        self._inflight = InFlight(decodes, ids, HostIds(ids), t0)

    def _chain(self) -> bool:
        """Launch the step after the one in flight from its device ids, then emit the in-flight tokens; False
        (nothing launched) when this tick has other work or no row goes on."""
        step = self._inflight
        assert step is not None
        if not chainable(step, bool(self._cancels), bool(self.waiting)):
            return False
        rows, ids = next_inputs(step, self.config.max_position)
        if not rows:
            return False
        # token_ids hold the previous token as a placeholder: the runner feeds ``ids`` instead
        works = [SeqWork(s.slot, s.block_table, s.computed, [s.output[-1]], want_logits=True) for s in rows]  # type: ignore[arg-type]
        self._launch(works, rows, ids)
        self._drain(step)
        for s in rows:
            if s.status is SeqStatus.DECODE:
                s.computed += 1
        if not any(s.status is SeqStatus.DECODE for s in rows):  # every row ended on the drained token (EOS)
            self._inflight = None  # nothing reads that step's ids
        return True

    def _drain(self, step: InFlight) -> None:
        """Wait for ``step``'s ids and emit them (rows retired meanwhile are skipped)."""
        if self._inflight is step:
            self._inflight = None
        tokens = step.host.wait()
        self.stats.stepped(
            prefill_tokens=0, decode_rows=len(step.seqs), seconds=time.monotonic() - step.launched_at
        )
        for s, token in zip(step.seqs, tokens, strict=True):
            if s.status is not SeqStatus.DECODE:
                continue
            try:
                self._emit(s, SampleResult(token=token))
            except Exception as exc:  # noqa: BLE001 - only this request ends
                self._sampling_failed(s, exc)
