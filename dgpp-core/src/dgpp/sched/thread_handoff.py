"""The one place the HTTP event loop's thread and the step loop's thread meet.

Inbound (``EngineInbox``): the HTTP side submits frozen ``GenerationRequest`` objects and cancels choices; the
step loop's thread drains both under the inbox's lock before each tick. Outbound (``EventRelay``): the step loop's
thread posts each choice's ``SeqEvent``; the event loop drains them onto the requests' queues in one callback
per tick. Nothing else is shared: the HTTP side never reads the scheduler (``/metrics`` reads what the step
loop publishes, ``dgpp.sched.published``).

Announcements (``announced``, ``submitted``; on the HTTP side): requests on their way to the engine are
announced when their handler starts and released once submitted. A burst's requests reach the engine one by
one as the event loop reads, validates and tokenizes them (about a millisecond each, so a 64-request burst
takes tens of milliseconds to arrive). With ``engine.admission_gather_max_ms`` set (off by default), an idle
engine holds its first arrival while announced requests are still on their way (``StepLoop._gather``, at most
that long), so the whole burst is prefilled in one step. A handler is wrapped in ``announced``;
``Backend.submit`` calls ``submitted`` right after it queues the request's sequences; the wrapper releases the
announcement on any other exit (a refused request, a disconnect).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from dgpp.media.prompt import PromptMedia
from dgpp.sample.params import SamplingParams
from dgpp.sched.request import EventSink, RetireReason, SeqEvent, SeqTiming, Sequence
from dgpp.sched.scheduler import QueueFull


@dataclass(frozen=True)
class GenerationRequest:
    """One request's generation, decided in full before it reaches the engine and never changed after: the
    prompt, the final ``SamplingParams`` (``max_tokens`` already fitted to the context), ``n`` choices, and one
    grammar matcher per choice when something constrains the output (``constraint``: what they were built
    from, journaled under tensor parallelism). ``forced_tokens``: the choice walks these tokens instead of
    sampling (a prompt's logprobs, ``ForcedSampler``). ``media``: the prompt's images (a model with a vision
    encoder)."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    n: int = 1
    use_prefix_cache: bool = True
    matchers: tuple[Any, ...] | None = None
    constraint: dict[str, Any] | None = None
    forced_tokens: tuple[int, ...] | None = None
    media: PromptMedia | None = None

    def choice_id(self, index: int) -> str:
        return f"{self.request_id}/{index}"


class StepLoopFailed(RuntimeError):
    """The model runner raised: the step loop serves no more requests (``/health`` says why)."""


class EngineInbox:
    """Requests and cancels on their way to the step loop's thread, and what that thread reports back about
    the hand-off itself (failure, shed and cancelled counts). Every field is read and written under ``cond``;
    ``submit`` checks ``engine.queue_limit`` against ``queued_requests`` (which the step loop's thread keeps:
    never fewer than are queued) and never walks the scheduler's queue."""

    def __init__(self, queue_limit: int, *, waits_for_announced: bool = False) -> None:
        self.queue_limit = queue_limit
        # ``StepLoop._gather`` can hold past ``engine.admission_gather_ms`` for a request announced by ``expect``
        # (``engine.admission_gather_max_ms`` above it); otherwise announcing is moot
        self.waits_for_announced = waits_for_announced
        self.cond = threading.Condition()
        self.requests: list[tuple[GenerationRequest, EventSink, float]] = []  # with its arrival time
        self.cancels: list[tuple[str, RetireReason]] = []
        self.queued_requests = 0
        self.expected = 0  # requests announced by ``expect`` and not yet submitted or dropped
        self.last_submit = 0.0
        self.stopping = False
        self.fail_pending = False
        self.failed: str | None = None
        self.requests_shed = 0
        self.requests_cancelled = 0

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue one request; ``QueueFull`` when ``engine.queue_limit`` would be passed, ``StepLoopFailed`` after
        a runner failure."""
        with self.cond:
            if self.failed is not None:
                raise StepLoopFailed(self.failed)
            waiting = self.queued_requests + len(self.requests)
            if waiting + 1 > self.queue_limit:
                self.requests_shed += 1
                raise QueueFull(f"{waiting} requests waiting; engine.queue_limit is {self.queue_limit}")
            self.last_submit = time.monotonic()
            self.requests.append((request, sink, self.last_submit))
            self.cond.notify()

    def cancel(self, choice_id: str, reason: RetireReason = RetireReason.CANCELLED) -> None:
        with self.cond:
            self.cancels.append((choice_id, reason))
            if reason is RetireReason.CANCELLED:
                self.requests_cancelled += 1
            self.cond.notify()

    def expect(self) -> None:
        """A request is on its way to ``submit`` (read, being validated and tokenized): an idle engine's
        admission hold waits for it. Every ``expect`` is matched by one ``unexpect``."""
        with self.cond:
            self.expected += 1

    def unexpect(self) -> None:
        """The request announced by ``expect`` was submitted, or will not be."""
        with self.cond:
            self.expected -= 1
            self.cond.notify()

    def shed(self) -> None:
        """A request refused before it was read (``engine.max_connections``)."""
        with self.cond:
            self.requests_shed += 1

    def fail(self, message: str) -> bool:
        """Mark the engine failed from any thread; the step loop's thread ends every request with ``message``.
        True the first time."""
        with self.cond:
            first = self.failed is None
            self.failed = self.failed or message
            self.fail_pending = True
            self.cond.notify()
        return first

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    @property
    def pending(self) -> tuple[int, int]:
        """(admissions, cancellations) waiting for the next tick."""
        with self.cond:
            return len(self.requests), len(self.cancels)


class EventRelay:
    """Posts ``(queue, item)`` pairs from the step loop's thread; the event loop puts them on their queues in
    one drain. ``loop.call_soon_threadsafe`` takes a lock and writes the loop's self-pipe on every call: at 64
    streams that was 64 syscalls and wake-ups per decode step, paid under the GIL the step loop's thread needs
    for the next step. Appends to the deque are atomic; one drain is scheduled while none is pending, so a
    tick's events reach their queues in one callback, in the order the engine produced them. ``on_retired``
    sees each finished choice's last timing and reason on the event loop (the request histograms)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_retired: Callable[[SeqTiming, RetireReason], None] | None = None,
    ) -> None:
        self.loop = loop
        self.on_retired = on_retired
        self._pending: deque[tuple[asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: tuple[int, SeqEvent]) -> None:
        self._pending.append((queue, item))
        with self._lock:
            if self._scheduled:  # a drain is queued and has not started popping: it will take this item
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed (shutdown): nobody is waiting for events any more
            pass

    def sink(self, queue: asyncio.Queue) -> EventSink:
        """A sequence sink (called on the step loop's thread) that relays ``(choice_index, event)`` to ``queue``."""

        def post_event(seq: Sequence, ev: SeqEvent) -> None:
            self.post(queue, (seq.choice_index, ev))

        return post_event

    def _drain(self) -> None:
        with self._lock:
            self._scheduled = False
        while self._pending:
            queue, item = self._pending.popleft()
            ev = item[1]
            if ev.retired is not None and ev.timing is not None and self.on_retired is not None:
                self.on_retired(ev.timing, ev.retired)
            queue.put_nowait(item)


# ---- announcements (HTTP side) ------------------------------------------------------------------


class _Announcement:
    def __init__(self, inbox: EngineInbox) -> None:
        self.inbox = inbox
        self.open = True
        inbox.expect()

    def release(self) -> None:
        if self.open:
            self.open = False
            self.inbox.unexpect()


_current: ContextVar[_Announcement | None] = ContextVar("dgpp_announcement", default=None)


def submitted() -> None:
    """The current request's sequences are queued: the engine no longer waits for it."""
    announcement = _current.get()
    if announcement is not None:
        announcement.release()


def announced(inbox_of: Callable[[Any], EngineInbox]) -> Callable:
    """Decorator for a generation route handler ``handler(request)``: announces the request to
    ``inbox_of(request)`` for as long as it has not been submitted."""

    def wrap(handler: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        @functools.wraps(handler)
        async def run(request: Any) -> Any:
            inbox = inbox_of(request)
            if not inbox.waits_for_announced:  # the plain hold (the default): no lock taken per request
                return await handler(request)
            announcement = _Announcement(inbox)
            token = _current.set(announcement)
            try:
                return await handler(request)
            finally:
                announcement.release()
                _current.reset(token)

        return run

    return wrap
