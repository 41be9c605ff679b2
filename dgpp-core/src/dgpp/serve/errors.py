"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` and stable ``code`` values."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException

log = structlog.get_logger("dgpp.serve")
# where the HTTP request's id rides in the ASGI scope (set by ``dgpp.serve.http_guard``)
REQUEST_ID_KEY = "dgpp.request_id"


class APIError(Exception):
    """An error answered to the client; 4xx are ``invalid_request_error``, 5xx ``server_error``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.log_fields: dict[
            str, Any
        ] = {}  # what the log line adds (e.g. the completion id), not the client

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None, code: str = "invalid_parameter") -> APIError:
    return APIError(400, message, code, param)


def unsupported(param: str, why: str = "is not supported") -> APIError:
    return APIError(400, f"{param} {why}", "unsupported_parameter", param)


RETRY_AFTER_S = 1


def overloaded(message: str) -> APIError:
    """503 ``overloaded``: the client may retry; ``Retry-After`` tells OpenAI SDKs (which honour it) when."""
    return APIError(503, message, "overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


def error_response(err: APIError) -> Response:
    return Response(
        content=msgspec.json.encode(err.body()),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers or None,
    )


async def send_error(send: Callable[[dict], Awaitable[None]], err: APIError) -> None:
    """The error as a whole ASGI response, for wrappers that answer before the app runs."""
    body = msgspec.json.encode(err.body())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def log_error(err: APIError, request_id: str | None, path: str, exc: BaseException | None = None) -> None:
    """Every error answered is logged once, one line with the request id and never the body: a client's mistake
    at info, overload at warning (the server is fine, it is busy), a server fault at error with the traceback
    of what raised it."""
    fields = {
        "request_id": request_id,
        "path": path,
        "status": err.status,
        "code": err.code,
        "param": err.param,
        **err.log_fields,
    }
    if err.code == "overloaded":
        log.warning("request shed", error=err.message, **fields)
    elif err.status >= 500:
        log.error("request failed", error=err.message, exc_info=exc if exc is not None else err, **fields)
    else:
        log.info("request rejected", error=err.message, **fields)


def request_id_of(request: Request) -> str | None:
    return request.scope.get(REQUEST_ID_KEY)  # type: ignore[call-overload]


def handle_api_error(request: Request, exc: APIError, cause: BaseException | None = None) -> Response:
    counters = getattr(request.app.state, "service", None)
    if counters is not None and exc.status < 500:
        counters.rejects_bad += 1
    log_error(exc, request_id_of(request), request.url.path, cause)
    return error_response(exc)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors (unknown route, wrong method, body it could not read) in OpenAI's shape."""
    if isinstance(exc, NotFoundException):
        err = APIError(404, f"unknown route: {request.method} {request.url.path}", None)
    elif isinstance(exc, MethodNotAllowedException):
        err = APIError(405, f"method {request.method} not allowed on {request.url.path}", None)
    elif exc.status_code == 413:  # a chunked body (no Content-Length) that grew past request_max_body_size
        err = APIError(413, "request body exceeds http.max_body_bytes", "request_too_large")
    else:
        status = exc.status_code
        err = APIError(status, str(exc.detail), "invalid_parameter" if status < 500 else "server_error")
    return handle_api_error(request, err)


def handle_unexpected(request: Request, exc: Exception) -> Response:
    """A bug, not the client's mistake: 500 without internals in the message (the log has the traceback)."""
    return handle_api_error(
        request, APIError(500, f"internal error: {type(exc).__name__}", "internal_error"), exc
    )
