"""A peer rank's engine: no HTTP, no inbox; it applies rank 0's journal tick by tick.

For each ``Tick`` it first compares rank 0's op-stream fold with its own (a mismatch stops the world
with ``op-stream divergence at tick N``), then rebuilds the admitted sequences bit for bit, applies
cancels and stops, and runs the same scheduler tick (whose collectives pair with rank 0's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dgpp.dist.channel import LineSocket, WorldError
from dgpp.dist.digest import OpStream
from dgpp.dist.journal import OpRecorder
from dgpp.dist.records import Admission, Diverged, Final, Stop, Tick, params_from_wire
from dgpp.log import get_logger
from dgpp.media.wire import media_from_wire
from dgpp.sample.sampler import ChoiceSampler
from dgpp.sched.request import RetireReason, SeqEvent, Sequence

log = get_logger("dgpp.dist")

EXIT_ORDERLY = 0
EXIT_RELEASED = 3  # a peer released by its watch (rank 0 gone, divergence, failed tick)


class DivergenceError(RuntimeError):
    """This rank's op stream disagrees with rank 0's."""


def _ignore(seq: Sequence, ev: SeqEvent) -> None:
    """Peers serve nobody: their events only feed the op stream."""


class Follower:
    """Runs ``scheduler`` from the journal on ``link`` until ``Stop`` (0) or a failure (3).

    ``constraint_matcher`` (``Backend.constraint_matcher``) builds a grammar matcher from a journaled
    constraint spec; without it a constrained admission fails the tick."""

    def __init__(self, link: LineSocket, scheduler: Any, vocab_size: int, stream: OpStream, rank: int,
                 constraint_matcher: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.link = link
        self.constraint_matcher = constraint_matcher
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.stream = stream
        self.rank = rank
        self.recorder = OpRecorder(scheduler, stream)
        self.error: str | None = None

    def run(self) -> int:
        while True:
            try:
                record = self.link.recv()
            except WorldError as e:  # rank 0 sent what this rank cannot read: released like any other failure
                self.error = str(e)
                log.error("released", rank=self.rank, reason=self.error)
                return EXIT_RELEASED
            if record is None:
                self.error = "rank 0 closed the journal"
                log.error("released", rank=self.rank, reason=self.error)
                return EXIT_RELEASED
            try:
                if isinstance(record, Stop):
                    self._check(record.n + 1, record.od)
                    self.link.send(Final(self.rank, self.stream.full_digest(), self.stream.fold))
                    log.info("op stream", rank=self.rank, md5=self.stream.full_digest(), ticks=record.n)
                    return EXIT_ORDERLY
                if isinstance(record, Tick):
                    self._check(record.n, record.od)
                    self._apply(record)
            except DivergenceError as e:
                self.error = str(e)
                log.error("released", rank=self.rank, reason=self.error)
                self._linger()
                return EXIT_RELEASED
            except Exception as e:  # a failed collective: rank 0 or another peer is gone
                self.error = f"tick failed: {type(e).__name__}: {e}"
                log.error("released", rank=self.rank, reason=self.error)
                return EXIT_RELEASED

    def _check(self, n: int, theirs: str) -> None:
        ours = self.stream.fold
        if ours != theirs:
            self.link.send(Diverged(self.rank, n, ours, theirs))
            raise DivergenceError(f"op-stream divergence at tick {n}: rank {self.rank} folded {ours}, rank 0 {theirs}")

    def _linger(self, seconds: float = 1.0) -> None:
        """Give rank 0's watcher time to read our report before our exit breaks its collectives."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.link.recv(timeout=seconds) is not None:
            pass

    def _apply(self, tick: Tick) -> None:
        for group in tick.s:
            # rank 0 accepted it against engine.queue_limit when it arrived: never refuse it here
            self.scheduler.submit(self._sequences(group), check_limit=False)
        for request_id, reason in tick.c:
            self.scheduler.cancel(request_id, RetireReason(reason))
        self.scheduler.tick()  # rank 0 ticks whenever it journals a tick, work or not
        self.recorder.end_tick(tick.n)

    def _sequences(self, group: list[Admission]) -> list[Sequence]:
        seqs: dict[str, Sequence] = {}
        for a in group:
            params = params_from_wire(a.sp)
            matcher = self._matcher(a)
            sampler = ChoiceSampler(params, self.vocab_size, a.p, choice_index=a.choice,
                                    mask_fn=matcher.mask if matcher else None, accept_fn=matcher.accept if matcher else None)
            sampler.generator.manual_seed(a.gs)
            seqs[a.id] = Sequence(a.id, a.choice, a.p, params, sampler, self.recorder.recording(_ignore),
                                  use_prefix_cache=a.prefix, leader=seqs.get(a.leader) if a.leader else None,
                                  constraint=a.g, media=media_from_wire(a.m))
        return list(seqs.values())

    def _matcher(self, a: Admission) -> Any:
        """The choice's own grammar matcher, compiled here from rank 0's spec (None when unconstrained)."""
        if a.g is None:
            return None
        if self.constraint_matcher is None:
            raise RuntimeError(f"{a.id}: constrained admission, but rank {self.rank} builds no grammar matchers")
        matcher = self.constraint_matcher(a.g)
        if matcher is None:  # rank 0 built one from the same spec, so this rank differs from it
            raise RuntimeError(f"{a.id}: the journaled constraint builds no matcher on rank {self.rank}")
        return matcher
