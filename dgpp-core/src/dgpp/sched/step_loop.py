"""The step loop: one thread that runs scheduler ticks apart from the HTTP event loop.

The HTTP side calls ``submit`` / ``cancel`` from any thread; they land in an inbox the step loop's thread
drains before each tick. Token events leave through each sequence's sink (called on that thread;
the serving side hands them to its event loop). After every pass the loop publishes the scheduler's gauges
(``published``, read by ``/metrics`` when scraped; the HTTP side never reads the scheduler itself), and while
busy it logs the periodic ``stats:`` line every ``stats_interval_s``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

import structlog

from dgpp.sched.published import Published
from dgpp.sched.request import RetireReason, SeqEvent, Sequence
from dgpp.sched.scheduler import QueueFull, Scheduler
from dgpp.sched.stats_line import StatsLine

log = structlog.get_logger("dgpp.engine")
GIL_SWITCH_S = 0.0005


class StepLoopFailed(RuntimeError):
    """The model runner raised: the step loop serves no more requests (``/health`` says why)."""


class StepLoop:
    """Owns a ``Scheduler`` on a daemon thread; thread-safe ``submit`` / ``cancel``."""

    def __init__(
        self, scheduler: Scheduler, stats_interval_s: float, *, gather_ms: float, gather_max_ms: float = 0.0
    ) -> None:
        self.scheduler = scheduler
        self.failed: str | None = None
        self.requests_shed = 0
        self.requests_cancelled = 0
        self._inbox: list[list[Sequence]] = []
        # requests in the scheduler's queue as this thread last saw it, plus those it has drained from the inbox
        # since: never fewer than are queued. ``submit`` checks the limit against it, under ``_cond``, and never
        # walks the scheduler's queue, which this loop's thread changes without the lock
        self._queued_requests = 0
        self._cancels: list[tuple[str, RetireReason]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dgpp-step-loop", daemon=True)
        self.published = Published(scheduler)
        self._stats_line = StatsLine(scheduler, stats_interval_s)
        self._gather_s = gather_ms / 1000.0
        self._gather_max_s = max(gather_ms, gather_max_ms) / 1000.0
        self._last_submit = 0.0
        self._expected = 0  # requests announced by ``expect`` and not yet submitted or dropped
        # tensor parallelism (dgpp.dist): rank 0 journals each tick's inputs before it runs, and a
        # failure seen off the step loop thread (a peer died) ends the step loop through ``fail``
        self.before_tick: Callable[[list[list[Sequence]], list[tuple[str, RetireReason]]], None] | None = None
        self.after_tick: Callable[[], None] | None = None
        self._fail_pending = False

    # ---- called from the serving side ---------------------------------------------------------
    def start(self) -> None:
        self._publish()
        # the engine thread shares the GIL with the HTTP event loop: by default a thread waiting for it waits
        # 5 ms before the holder is asked to let go, which a 10 ms decode step cannot afford
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the choices of one request; ``QueueFull`` when ``engine.queue_limit`` would be passed,
        ``StepLoopFailed`` after a runner failure."""
        with self._cond:
            if self.failed is not None:
                raise StepLoopFailed(self.failed)
            waiting = self._queued_requests + len(self._inbox)
            if waiting + 1 > self.scheduler.config.queue_limit:
                self.requests_shed += 1
                raise QueueFull(
                    f"{waiting} requests waiting; engine.queue_limit is {self.scheduler.config.queue_limit}"
                )
            self._inbox.append(seqs)
            self._last_submit = time.monotonic()
            self._cond.notify()

    @property
    def waits_for_announced(self) -> bool:
        """Whether ``_gather`` can hold past ``gather_ms`` for a request announced by ``expect``
        (``engine.admission_gather_max_ms`` above ``admission_gather_ms``); otherwise announcing is moot."""
        return self._gather_max_s > self._gather_s

    def expect(self) -> None:
        """A request is on its way to ``submit`` (read, being validated and tokenized): an idle engine's
        admission hold (``_gather``) waits for it. Every ``expect`` is matched by one ``unexpect``."""
        with self._cond:
            self._expected += 1

    def unexpect(self) -> None:
        """The request announced by ``expect`` was submitted, or will not be."""
        with self._cond:
            self._expected -= 1
            self._cond.notify()

    def cancel(self, request_id: str, reason: RetireReason = RetireReason.CANCELLED) -> None:
        with self._cond:
            self._cancels.append((request_id, reason))
            if reason is RetireReason.CANCELLED:
                self.requests_cancelled += 1
            self._cond.notify()

    def fail(self, message: str) -> None:
        """Mark the engine failed from any thread; the step loop thread ends every request with ``message``."""
        with self._cond:
            if self.failed is None:
                self.failed = message
                log.error("engine failure", error=message)
            self._fail_pending = True
            self._cond.notify()

    def on_retire(self, hook: Callable[[Sequence], None]) -> None:
        """Call ``hook`` on this loop's thread for every retired sequence (request histograms). Before ``start``."""
        self.scheduler.on_retire.append(hook)

    @property
    def pending(self) -> tuple[int, int]:
        """(admissions, cancellations) waiting for the next tick."""
        with self._cond:
            return len(self._inbox), len(self._cancels)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        sched = self.scheduler
        while True:
            with self._cond:
                self._queued_requests = sched.waiting_requests
                while not (
                    self._stop or self._fail_pending or self._inbox or self._cancels or sched.has_work
                ):
                    self._cond.wait(timeout=1.0)
                    self._stats_line.maybe_log(idle=True)
                if self._stop:
                    return
                if self._fail_pending:
                    message = self.failed or "engine failed"
                    self._fail_inbox(message)
                    sched.fail_all(message)
                    self._publish()
                    return
                if self._gather_s and self._inbox and not sched.has_work:
                    self._gather()
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                self._queued_requests += len(inbox)
            try:
                if self.before_tick is not None:
                    self.before_tick(inbox, cancels)
                for group in inbox:
                    sched.submit(group, check_limit=False)
                for request_id, reason in cancels:
                    sched.cancel(request_id, reason)
                sched.tick()
                if self.after_tick is not None:
                    self.after_tick()
                self._publish()
                self._stats_line.maybe_log(idle=False)
            except Exception as exc:  # the runner failed: nothing more can be computed
                with self._cond:  # a failure already reported (e.g. a peer's) is the cause: keep it
                    self.failed = self.failed or f"{type(exc).__name__}: {exc}"
                    # requests submitted while this tick ran passed submit()'s check before ``failed`` was
                    # set; nothing will drain the inbox again, so they end here instead of waiting forever
                    self._fail_inbox(self.failed)
                log.error("engine failure", error=self.failed, traceback=traceback.format_exc())
                sched.fail_all(self.failed)
                self._publish()
                return

    def _fail_inbox(self, message: str) -> None:
        """End the requests that never reached the scheduler with ``message``. Called holding the lock."""
        for group in self._inbox:
            for s in group:
                s.sink(s, SeqEvent(tokens=[], samples=[], retired=RetireReason.FAILED, error=message))
        self._inbox = []

    def _gather(self) -> None:
        """engine.admission_gather_ms / admission_gather_max_ms: an idle engine holds its first arrival until
        no request has arrived for ``gather_ms`` and none announced by ``expect`` is still on its way (or
        ``gather_max_ms`` have passed), so a burst is admitted and
        prefilled in one step instead of a few of its requests in a step of their own and the rest a step later
        (its requests reach the engine over tens of milliseconds: each is read, validated and tokenized on the
        event loop). ``gather_max_ms`` 0 (the default) keeps the plain ``gather_ms`` hold from the first arrival:
        waiting for a burst's last arrival measured slower than the extra step it saves (docs/configuration.md).
        Called holding the lock."""
        cap = time.monotonic() + self._gather_max_s
        while not self._stop:
            now = time.monotonic()
            quiet = self._last_submit + self._gather_s - now
            if now >= cap or (quiet <= 0 and not self._expected):
                return
            # a request announced by ``expect`` ends the wait when it is submitted (``submit`` notifies)
            self._cond.wait(timeout=min(cap - now, quiet) if quiet > 0 else cap - now)

    def _publish(self) -> None:
        self.published.publish(self.scheduler)
