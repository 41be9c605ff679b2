"""Logging through structlog: readable console lines for people, JSON lines for machines.

Every line carries a UTC timestamp with milliseconds. ``DGPP_LOG_LEVEL`` (debug/info/warning/error)
sets the level unless ``configure_logging`` is given one. Long loads report progress through
``progress(iterable, total, what)``. Logs go to stderr so stdout stays free for command output.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import structlog

T = TypeVar("T")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_configured = False
_stdlib_handler: logging.Handler | None = None


def _utc_ms_timestamp(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    event["timestamp"] = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return event


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write.

    Binding the stream object at configure time breaks once it is closed or replaced (pytest's capture
    closes each test's stream; a daemon may redirect stderr): later lines would raise on a closed file.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())


def configure_logging(json: bool = False, level: str | None = None, stream: Any = None) -> None:
    """Set up structlog (and route stdlib ``logging`` through the same renderer)."""
    global _configured, _stdlib_handler
    name = (level or os.environ.get("DGPP_LOG_LEVEL") or "info").lower()
    if name not in _LEVELS:
        raise ValueError(f"log level {name!r}: expected one of {', '.join(_LEVELS)}")
    stream = stream or _CurrentStderr()
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _utc_ms_timestamp,
    ]
    if json:
        renderer: Any = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        colors = bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")
        # tracebacks without local variables: a handler's locals hold the request body (a 2 KB request logged
        # 175 KB), and a log is no place for a client's prompts
        if isinstance(structlog.dev.default_exception_formatter, structlog.dev.RichTracebackFormatter):
            formatter: Any = structlog.dev.RichTracebackFormatter(show_locals=False)
        else:
            formatter = structlog.dev.plain_traceback
        renderer = structlog.dev.ConsoleRenderer(colors=colors, exception_formatter=formatter)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[name]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    if _stdlib_handler is not None:  # replace only our own handler: others (pytest's caplog) stay
        root.removeHandler(_stdlib_handler)
    root.addHandler(handler)
    root.setLevel(_LEVELS[name])
    _stdlib_handler = handler
    _configured = True


def get_logger(name: str = "dgpp") -> Any:
    """A structlog logger bound to ``logger=name`` (configures console logging on first use)."""
    if not _configured:
        configure_logging()
    return structlog.get_logger().bind(logger=name)


def progress(iterable: Iterable[T], total: int | None, what: str, every_s: float = 2.0) -> Iterator[T]:
    """Yield from ``iterable``, logging ``what`` done/total at most every ``every_s`` seconds and at the end.

    For loads that take a while (reading shards, building a demo): a person sees it move.
    """
    log = get_logger("dgpp.progress")
    start = last = time.monotonic()
    done = 0
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s and (total is None or done < total):
            last = now
            pct = f" ({100 * done // total}%)" if total else ""
            log.info(
                what,
                done=done,
                total=total,
                progress=f"{done}/{total or '?'}{pct}",
                elapsed_s=round(now - start, 1),
            )
    log.info(what + " done", done=done, total=total, elapsed_s=round(time.monotonic() - start, 1))
