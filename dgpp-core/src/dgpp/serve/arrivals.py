"""Requests on their way to the engine: announced when their handler starts, released once submitted.

A burst's requests reach the engine one by one as the event loop reads, validates and tokenizes them (about a
millisecond each, so a 64-request burst takes tens of milliseconds to arrive). With ``engine.admission_gather_max_ms`` set (off by
default), an idle engine holds its first arrival while announced requests are still on their way
(``StepLoop._gather``, at most that long), so the whole burst is prefilled in one step. A handler is wrapped in ``announced``; ``Backend.submit`` calls
``submitted`` right after it queues the request's sequences; the wrapper releases the announcement on any
other exit (a refused request, a disconnect).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from dgpp.sched.thread_handoff import EngineInbox


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
