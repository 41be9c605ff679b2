"""The step loop: one thread that runs scheduler ticks apart from the HTTP event loop.

The HTTP side submits requests and cancels through the ``EngineInbox`` (``dgpp.sched.thread_handoff``); this
thread drains it before each tick, turns each ``GenerationRequest`` into its scheduler sequences
(``choices_of``: samplers are built here, not on the HTTP side) and ticks. Token events leave through each
sequence's sink. After every pass the loop publishes the scheduler's gauges (``published``, read by
``/metrics`` when scraped), and while busy it logs the periodic ``stats:`` line every ``stats_interval_s``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Protocol

import structlog

from dgpp.sample.forced import ForcedSampler
from dgpp.sample.sampler import ChoiceSampler
from dgpp.sched.published import Published, StatsLine
from dgpp.sched.request import EventSink, RetireReason, SeqEvent, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.sched.thread_handoff import EngineInbox, GenerationRequest

log = structlog.get_logger("dgpp.engine")
GIL_SWITCH_S = 0.0005


class TickJournal(Protocol):
    """What a tensor-parallel rank 0 records around each tick (``dgpp.dist.journal.JournalWriter``)."""

    def recording(self, sink: EventSink) -> EventSink:
        """``sink`` with the journal's record of each event in front of it."""
        ...

    def before_tick(self, inbox: list[list[Sequence]], cancels: list[tuple[str, RetireReason]]) -> None: ...

    def after_tick(self) -> None: ...


class StepLoop:
    """Owns a ``Scheduler`` on a daemon thread; the HTTP side reaches it through ``inbox`` only.

    ``journal`` (tensor parallelism, rank 0): records each tick's inputs before it runs and every event."""

    def __init__(
        self,
        scheduler: Scheduler,
        stats_interval_s: float,
        *,
        vocab_size: int,
        gather_ms: float,
        gather_max_ms: float = 0.0,
        journal: TickJournal | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.journal = journal
        self._gather_s = gather_ms / 1000.0
        self._gather_max_s = max(gather_ms, gather_max_ms) / 1000.0
        self.inbox = EngineInbox(
            scheduler.config.queue_limit, waits_for_announced=self._gather_max_s > self._gather_s
        )
        self._thread = threading.Thread(target=self._run, name="dgpp-step-loop", daemon=True)
        self.published = Published(scheduler)
        self._stats_line = StatsLine(scheduler, stats_interval_s)

    def start(self) -> None:
        self._publish()
        # the engine thread shares the GIL with the HTTP event loop: by default a thread waiting for it waits
        # 5 ms before the holder is asked to let go, which a 10 ms decode step cannot afford
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.inbox.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def failed(self) -> str | None:
        return self.inbox.failed

    def fail(self, message: str) -> None:
        """Mark the engine failed from any thread (a peer died); this thread ends every request with ``message``."""
        if self.inbox.fail(message):
            log.error("engine failure", error=message)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        sched, inbox = self.scheduler, self.inbox
        while True:
            with inbox.cond:
                inbox.queued_requests = sched.waiting_requests
                while not (
                    inbox.stopping or inbox.fail_pending or inbox.requests or inbox.cancels or sched.has_work
                ):
                    inbox.cond.wait(timeout=1.0)
                    self._stats_line.maybe_log(idle=True)
                if inbox.stopping:
                    return
                if inbox.fail_pending:
                    message = inbox.failed or "engine failed"
                    self._fail_inbox(message)
                    sched.fail_all(message)
                    self._publish()
                    return
                if self._gather_s and inbox.requests and not sched.has_work:
                    self._gather()
                requests, inbox.requests = inbox.requests, []
                cancels, inbox.cancels = inbox.cancels, []
                inbox.queued_requests += len(requests)
            try:
                groups = [self._choices(*submitted) for submitted in requests]
                if self.journal is not None:
                    self.journal.before_tick(groups, cancels)
                for group in groups:
                    sched.submit(group, check_limit=False)
                for choice_id, reason in cancels:
                    sched.cancel(choice_id, reason)
                sched.tick()
                if self.journal is not None:
                    self.journal.after_tick()
                self._publish()
                self._stats_line.maybe_log(idle=False)
            except Exception as exc:  # the runner failed: nothing more can be computed
                with inbox.cond:  # a failure already reported (e.g. a peer's) is the cause: keep it
                    inbox.failed = inbox.failed or f"{type(exc).__name__}: {exc}"
                    # requests submitted while this tick ran passed submit()'s check before ``failed`` was
                    # set; nothing will drain the inbox again, so they end here instead of waiting forever
                    self._fail_inbox(inbox.failed)
                log.error("engine failure", error=inbox.failed, traceback=traceback.format_exc())
                sched.fail_all(inbox.failed)
                self._publish()
                return

    def _choices(self, request: GenerationRequest, sink: EventSink, arrival: float) -> list[Sequence]:
        if self.journal is not None:
            sink = self.journal.recording(sink)
        return choices_of(request, sink, self.vocab_size, arrival)

    def _fail_inbox(self, message: str) -> None:
        """End the requests that never reached the scheduler with ``message``. Called holding the lock."""
        for request, sink, arrival in self.inbox.requests:
            for s in choices_of(request, sink, self.vocab_size, arrival):
                sink(s, SeqEvent(tokens=[], samples=[], retired=RetireReason.FAILED, error=message))
        self.inbox.requests = []

    def _gather(self) -> None:
        """engine.admission_gather_ms / admission_gather_max_ms: an idle engine holds its first arrival until
        no request has arrived for ``gather_ms`` and none announced by ``expect`` is still on its way (or
        ``gather_max_ms`` have passed), so a burst is admitted and
        prefilled in one step instead of a few of its requests in a step of their own and the rest a step later
        (its requests reach the engine over tens of milliseconds: each is read, validated and tokenized on the
        event loop). ``gather_max_ms`` 0 (the default) keeps the plain ``gather_ms`` hold from the first arrival:
        waiting for a burst's last arrival measured slower than the extra step it saves (docs/configuration.md).
        Called holding the lock."""
        inbox = self.inbox
        cap = time.monotonic() + self._gather_max_s
        while not inbox.stopping:
            now = time.monotonic()
            quiet = inbox.last_submit + self._gather_s - now
            if now >= cap or (quiet <= 0 and not inbox.expected):
                return
            # a request announced by ``expect`` ends the wait when it is submitted (``submit`` notifies)
            inbox.cond.wait(timeout=min(cap - now, quiet) if quiet > 0 else cap - now)

    def _publish(self) -> None:
        self.published.publish(self.scheduler)


def choices_of(
    request: GenerationRequest, sink: EventSink, vocab_size: int, arrival: float | None = None
) -> list[Sequence]:
    """The request's ``n`` choices as scheduler sequences, each with its own sampler (seeded choices of one
    request differ: each draws from (seed, choice index)), arrived at ``arrival`` (now when None). Run on the
    step loop's thread."""
    arrived = time.monotonic() if arrival is None else arrival
    prompt = list(request.prompt)
    seqs: list[Sequence] = []
    for i in range(request.n):
        matcher = request.matchers[i] if request.matchers else None
        if request.forced_tokens is not None:
            top = request.params.top_logprobs
            sampler: ChoiceSampler = ForcedSampler(list(request.forced_tokens), vocab_size, prompt, top)
        else:
            sampler = ChoiceSampler(
                request.params,
                vocab_size,
                prompt,
                choice_index=i,
                mask_fn=matcher.mask if matcher else None,
                accept_fn=matcher.accept if matcher else None,
            )
        seqs.append(
            Sequence(
                request.choice_id(i),
                i,
                prompt,
                sampler.params,
                sampler,
                sink,
                use_prefix_cache=request.use_prefix_cache,
                leader=seqs[0] if i else None,
                constraint=request.constraint if matcher else None,
                arrival=arrived,
                media=request.media,
            )
        )
    return seqs
