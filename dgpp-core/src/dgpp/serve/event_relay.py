"""Token events from the engine thread to the event loop, one wake-up per engine tick instead of one per sequence.

``loop.call_soon_threadsafe`` takes a lock and writes the loop's self-pipe on every call: at 64 streams that is
64 syscalls and 64 loop wake-ups per decode step, paid under the GIL the engine thread needs to launch the next
step. The relay queues events in a deque (appends are atomic) and schedules one drain while none is pending, so a
tick's events reach their request queues in one callback, in the order the engine produced them.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from dgpp.sched.request import SeqEvent, Sequence


class EventRelay:
    """Posts ``(queue, item)`` pairs from any thread; the loop puts them on their queues in one drain."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: deque[tuple[asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        self._pending.append((queue, item))
        with self._lock:
            if self._scheduled:  # a drain is queued and has not started popping: it will take this item
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed (shutdown): nobody is waiting for events any more
            pass

    def sink(self, queue: asyncio.Queue) -> Callable[[Sequence, SeqEvent], None]:
        """A sequence sink (called on the step loop's thread) that relays ``(choice_index, event)`` to ``queue``."""

        def post_event(seq: Sequence, ev: SeqEvent) -> None:
            self.post(queue, (seq.choice_index, ev))

        return post_event

    def _drain(self) -> None:
        with self._lock:
            self._scheduled = False
        while self._pending:
            queue, item = self._pending.popleft()
            queue.put_nowait(item)
