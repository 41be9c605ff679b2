"""Rank 0's side of the admission journal and the op-stream recorder every rank runs.

Before each tick, rank 0 sends the tick's admissions, cancels and stops to every peer together with
the fold of its op stream so far; then it ticks. Peers (``follower``) apply the same inputs and tick
the same way, so every rank makes the same scheduler decisions and the same collectives in the same
order. ``OpRecorder`` writes those decisions into the op stream identically on every rank.
"""

from __future__ import annotations

import time
from typing import Any

from dgpp.dist.channel import JournalHub, WorldError
from dgpp.dist.digest import OpStream
from dgpp.dist.records import Admission, Stop, Tick, params_to_wire
from dgpp.log import get_logger
from dgpp.media.wire import media_to_wire
from dgpp.sched.request import EventSink, RetireReason, SeqEvent, Sequence

log = get_logger("dgpp.dist")


class OpRecorder:
    """Appends a rank's scheduler decisions to its ``OpStream``: tokens and retirements through each
    sequence's sink, admissions (slot, prefix-cache hit, blocks) after each tick, then ``T n``."""

    def __init__(self, scheduler: Any, stream: OpStream) -> None:
        self.scheduler = scheduler
        self.stream = stream
        self._admitted: set[str] = set()

    def recording(self, inner: EventSink) -> EventSink:
        """A sequence sink that records each event in the op stream, then hands it to ``inner``."""

        def sink(s: Sequence, ev: SeqEvent) -> None:
            self.record_event(s, ev)
            inner(s, ev)

        return sink

    def record_event(self, s: Sequence, ev: SeqEvent) -> None:
        for token in ev.tokens:
            self.stream.add(f"K {s.request_id} {token}")
        if ev.retired is not None:
            self._admitted.discard(s.request_id)
            self.stream.add(f"R {s.request_id} {ev.retired.value} {ev.cached_tokens}")

    def end_tick(self, n: int) -> None:
        for s in self.scheduler.live:  # admission order
            if s.request_id not in self._admitted:
                self._admitted.add(s.request_id)
                blocks = ",".join(map(str, s.block_table))
                self.stream.add(f"A {s.request_id} {s.slot} {s.cached_tokens} {blocks}")
        self.stream.add(f"T {n}")


def admission_of(s: Sequence) -> Admission:
    """Everything a peer needs to rebuild ``s`` exactly (the generator seed as drawn here, the grammar
    constraint its mask was built from)."""
    if s.sampler.mask_fn is not None and s.constraint is None:
        raise WorldError(f"{s.request_id}: a token mask without its constraint spec cannot be journaled")
    return Admission(
        id=s.request_id, choice=s.choice_index, p=list(s.prompt), sp=params_to_wire(s.params),
        gs=s.sampler.generator.initial_seed(), leader=s.leader.request_id if s.leader is not None else None,
        prefix=s.use_prefix_cache, g=s.constraint, m=media_to_wire(s.media),
    )


class JournalWriter:
    """Rank 0's ``StepLoop`` journal (``recording``, ``before_tick``, ``after_tick``) plus the orderly ``stop``."""

    def __init__(self, hub: JournalHub, scheduler: Any, stream: OpStream) -> None:
        self.hub = hub
        self.recorder = OpRecorder(scheduler, stream)
        self.stream = stream
        self.tick = 0
        # progress for the watchdog: when the running tick began (None between ticks), last tick end
        self.tick_started: float | None = None
        self.last_progress = time.monotonic()

    def recording(self, sink: EventSink) -> EventSink:
        return self.recorder.recording(sink)

    def before_tick(self, inbox: list[list[Sequence]], cancels: list[tuple[str, RetireReason]]) -> None:
        groups = [[admission_of(s) for s in group] for group in inbox]
        self.tick += 1
        self.hub.broadcast(Tick(n=self.tick, od=self.stream.fold, s=groups,
                                c=[(rid, reason.value) for rid, reason in cancels]))
        self.tick_started = time.monotonic()

    def after_tick(self) -> None:
        self.recorder.end_tick(self.tick)
        self.tick_started = None
        self.last_progress = time.monotonic()

    def stop(self, timeout_s: float = 30.0) -> dict[int, str]:
        """Tell the peers to stop; every rank's full-stream digest (rank 0's included), or ``WorldError``
        naming the ranks whose stream differs."""
        self.hub.broadcast(Stop(n=self.tick, od=self.stream.fold))
        finals = self.hub.wait_finals(timeout_s)
        digests = {0: self.stream.full_digest()} | {r: f.full for r, f in finals.items()}
        for rank, digest in sorted(digests.items()):
            log.info("op stream", rank=rank, md5=digest, ticks=self.tick)
        missing = sorted(set(self.hub.peers) - set(finals))
        differing = sorted(r for r, d in digests.items() if d != digests[0])
        if missing or differing:
            raise WorldError(f"op streams at shutdown: ranks {differing} differ from rank 0"
                             + (f", ranks {missing} sent none" if missing else ""))
        return digests
