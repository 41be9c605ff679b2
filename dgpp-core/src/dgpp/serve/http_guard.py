"""The ASGI wrappers around the app: a request id for every HTTP request, the optional API key check, and a
request body read whole, within a deadline and a size limit, before anything else sees it (``BodyGuard``, the
outer one); then ``engine.max_connections`` (``ConnectionLimit``, inside it).

Why the body is read here and not in the app: a client that sends headers and then trickles (or never
finishes) its body would otherwise hold an ``engine.max_connections`` slot, a Litestar handler and a read
buffer for as long as it likes; 64 of them starved every route, ``/health`` included. Reading the body first,
with ``http.body_timeout_s`` for the whole of it, means such a client costs one idle socket until the deadline
and never counts against the limit. A body larger than ``http.max_body_bytes`` is refused as soon as its
Content-Length says so, or as soon as that many bytes have arrived for a chunked one, without buffering the
rest.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Callable
from typing import Any

from dgpp.serve.access import ApiKey
from dgpp.serve.errors import REQUEST_ID_KEY, APIError, invalid, log_error, overloaded, send_error

_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:/-]{1,128}")
_BODY_METHODS = ("POST", "PUT", "PATCH")


class _Disconnected(Exception):
    pass


def request_id(scope: dict[str, Any]) -> str:
    """The client's ``X-Request-Id`` when it is a sane token, else a fresh ``req-<hex>``."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and _CLIENT_ID.fullmatch(value):
            return value.decode("ascii")
    return f"req-{secrets.token_hex(8)}"


class BodyGuard:
    """Tags each HTTP request with an id (echoed as ``x-request-id``), then reads a body-carrying request's
    body in full (``timeout_s`` for all of it, at most ``max_body_bytes``) and hands the app a replay of it."""

    def __init__(
        self, app: Any, max_body_bytes: int, timeout_s: float, api_key: ApiKey | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope[REQUEST_ID_KEY] = request_id(scope)
        send = _with_request_id(send, rid)
        refusal = self.api_key.refusal(scope) if self.api_key is not None else None
        if refusal is not None:
            return await self._refuse(scope, send, refusal)
        if scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(scope, receive), self.timeout_s)
        except APIError as err:
            return await self._refuse(scope, send, err)
        except TimeoutError:
            err = APIError(
                408,
                f"the request body did not arrive within http.body_timeout_s = {self.timeout_s:g} s",
                "request_timeout",
            )
            return await self._refuse(scope, send, err)
        except _Disconnected:
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body, the only message left is the disconnect

        await self.app(scope, replay, send)

    async def _read(self, scope: dict, receive: Callable) -> bytes:
        declared = content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            raise self._too_large(declared)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> APIError:
        return APIError(
            413,
            f"request body of {size} bytes or more exceeds http.max_body_bytes = {self.max_body_bytes}",
            "request_too_large",
        )

    async def _refuse(self, scope: dict, send: Callable, err: APIError) -> None:
        log_error(err, scope[REQUEST_ID_KEY], scope.get("path", ""))
        await send_error(send, err)


def content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP parser refuses these first; kept for servers that do not
                raise invalid("Content-Length is not a number", None) from None
    return None


def _with_request_id(send: Callable, rid: str) -> Callable:
    header = (b"x-request-id", rid.encode("ascii"))

    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), header]}
        await send(message)

    return sending


class ConnectionLimit:
    """``engine.max_connections``: requests in flight beyond it get an OpenAI-shaped 503 ``overloaded``;
    ``on_reject`` is told about each refusal (for ``requests_shed``).

    An ASGI wrapper, so the refusal happens before routing (uvicorn's own ``limit_concurrency`` answers plain
    text, which OpenAI clients cannot parse). It sits inside ``BodyGuard``: a request counts only once its body
    has arrived, so clients that trickle bodies in cannot hold the slots, and ``/health`` and the other GET
    routes are never counted (they do no model work)."""

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
