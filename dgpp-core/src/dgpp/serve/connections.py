"""``engine.max_connections``: requests in flight beyond it get an OpenAI-shaped 503 ``overloaded``.

An ASGI wrapper around the app, so the refusal happens before routing or reading the body (uvicorn's own
``limit_concurrency`` answers plain text, which OpenAI clients cannot parse).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from dgpp.serve.errors import APIError


class ConnectionLimit:
    """Counts HTTP requests in flight; ``on_reject`` is told about each refusal (for ``requests_shed``)."""

    def __init__(self, app: Any, limit: int, on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.on_reject = on_reject
        self.active = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            if self.on_reject is not None:
                self.on_reject()
            err = APIError(503, f"server overloaded: {self.active} requests in flight; engine.max_connections is "
                                f"{self.limit}", "overloaded")
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": msgspec.json.encode(err.body())})
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
