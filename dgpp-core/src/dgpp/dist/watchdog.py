"""Rank 0's failure handling: a progress watchdog for silent hangs and the exit that
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

    def start(self, interval_s: float | None = None) -> threading.Event:
        """Check every ``interval_s`` on a daemon thread until a stall is reported or the returned event is set."""
        interval = interval_s or min(1.0, self.limit_s / 4)
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                if (message := self.check()) is not None:
                    self.on_stall(message)
                    return

        threading.Thread(target=loop, name="dgpp-progress-watchdog", daemon=True).start()
        return stop


def call_naming_departure(hub: Any, wait_s: float, call: Callable[[], Any]) -> Any:
    """``call()``; when it raises and the journal watch saw a peer leave (within ``wait_s``), a RuntimeError
    naming that peer replaces the transport's message (the original stays as its cause)."""
    try:
        return call()
    except Exception as e:
        cause = hub.wait_departure(wait_s)
        if cause is None:
            raise
        raise RuntimeError(cause) from e


class PeerAwareRunner:
    """Wraps rank 0's model runner: when a step fails because a collective broke (a peer died), the
    error names the peer the journal watch saw leave, not the transport's message."""

    def __init__(self, runner: Any, hub: Any, wait_s: float = 1.0) -> None:
        self.runner = runner
        self.hub = hub
        self.wait_s = wait_s

    def step(self, works: Any) -> Any:
        return call_naming_departure(self.hub, self.wait_s, lambda: self.runner.step(works))

    def __getattr__(self, name: str) -> Any:  # model, pools, graphs: the wrapped runner's
        return getattr(self.runner, name)


class PeerAwareDecoder:
    """Wraps rank 0's ``SpeculativeDecoder`` (``engine.mtp``) the way ``PeerAwareRunner`` wraps the runner: its
    decode pass (drafter, verify forward, TP head gathers) holds a reference to the bare runner, so a
    collective broken by a dead peer during it would otherwise surface as the transport's message."""

    def __init__(self, decoder: Any, hub: Any, wait_s: float = 1.0) -> None:
        self.decoder = decoder
        self.hub = hub
        self.wait_s = wait_s

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        return call_naming_departure(self.hub, self.wait_s, lambda: self.decoder.decode(*args, **kwargs))

    def after_prefill(self, *args: Any, **kwargs: Any) -> Any:
        return call_naming_departure(self.hub, self.wait_s, lambda: self.decoder.after_prefill(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:  # stats, depth, drafter: the wrapped decoder's
        return getattr(self.decoder, name)


def name_departed_peers(runner: Any, speculative: Any, hub: Any, wait_s: float = 1.0) -> tuple[Any, Any]:
    """Rank 0's runner and speculative decoder (None without ``engine.mtp``), each routed through the journal
    watch, so a step broken by a peer's death is reported by the peer's name."""
    decoder = PeerAwareDecoder(speculative, hub, wait_s) if speculative is not None else None
    return PeerAwareRunner(runner, hub, wait_s), decoder


def exit_after_failure(loop: Any, grace_s: float = FAILURE_GRACE_S,
                       before_exit: Callable[[], None] | None = None) -> threading.Event:
    """Once ``loop.failed`` is set, give streams ``grace_s`` to end, then leave with exit code 2
    (uvicorn would otherwise keep answering 503 forever). Setting the returned event disarms it."""
    stop = threading.Event()

    def watch() -> None:
        while loop.failed is None:
            if stop.wait(0.05):
                return
        if stop.wait(grace_s):
            return
        log.error("rank 0 exits after engine failure", error=loop.failed, code=EXIT_ENGINE_FAILURE)
        if before_exit is not None:
            before_exit()
        os._exit(EXIT_ENGINE_FAILURE)

    threading.Thread(target=watch, name="dgpp-failure-exit", daemon=True).start()
    return stop
