"""Rank 0's failure handling (anchor §4.10): a progress watchdog for silent hangs and the exit that
follows an engine failure once live streams have had their ``engine_failure`` event."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from dgpp.log import get_logger

log = get_logger("dgpp.dist")

EXIT_ENGINE_FAILURE = 2  # rank 0 engine failure or forced exit
PROGRESS_LIMIT_S = 120.0
FAILURE_GRACE_S = 3.0


class ProgressWatchdog:
    """Reports a tick that has run for longer than ``limit_s`` (a collective that never completes:
    a silent peer, a wedged device). ``progress`` exposes ``tick_started`` (None between ticks)."""

    def __init__(self, progress: Any, limit_s: float, on_stall: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.progress = progress
        self.limit_s = limit_s
        self.on_stall = on_stall
        self.clock = clock

    def check(self) -> str | None:
        started = self.progress.tick_started
        if started is not None and (stalled := self.clock() - started) > self.limit_s:
            return f"engine progress watchdog: tick {self.progress.tick} has made no progress for {stalled:.1f} s"
        return None

    def start(self, interval_s: float | None = None) -> None:
        interval = interval_s or min(1.0, self.limit_s / 4)

        def loop() -> None:
            while (message := self.check()) is None:
                time.sleep(interval)
            self.on_stall(message)

        threading.Thread(target=loop, name="dgpp-progress-watchdog", daemon=True).start()


def exit_after_failure(loop: Any, grace_s: float = FAILURE_GRACE_S,
                       before_exit: Callable[[], None] | None = None) -> None:
    """Once ``loop.failed`` is set, give streams ``grace_s`` to end, then leave with exit code 2
    (uvicorn would otherwise keep answering 503 forever)."""

    def watch() -> None:
        while loop.failed is None:
            time.sleep(0.05)
        time.sleep(grace_s)
        log.error("rank 0 exits after engine failure", error=loop.failed, code=EXIT_ENGINE_FAILURE)
        if before_exit is not None:
            before_exit()
        os._exit(EXIT_ENGINE_FAILURE)

    threading.Thread(target=watch, name="dgpp-failure-exit", daemon=True).start()
