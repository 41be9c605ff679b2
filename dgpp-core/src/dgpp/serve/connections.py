"""``engine.max_connections``: requests in flight beyond it get an OpenAI-shaped 503 ``overloaded``.

An ASGI wrapper around the app, so the refusal happens before routing (uvicorn's own ``limit_concurrency``
answers plain text, which OpenAI clients cannot parse). It sits inside ``http_guard.BodyGuard``: a request
counts only once its body has arrived, so clients that trickle bodies in cannot hold the slots, and
``/health`` and the other GET routes are never counted (they do no model work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dgpp.serve.errors import REQUEST_ID_KEY, log_error, overloaded, send_error


class ConnectionLimit:
    """Counts HTTP requests in flight; ``on_reject`` is told about each refusal (for ``requests_shed``)."""

    def __init__(self, app: Any, limit: int, on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.on_reject = on_reject
        self.active = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            if self.on_reject is not None:
                self.on_reject()
            err = overloaded(
                f"server overloaded: {self.active} requests in flight; engine.max_connections is {self.limit}"
            )
            log_error(err, scope.get(REQUEST_ID_KEY), scope.get("path", ""))
            await send_error(send, err)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
