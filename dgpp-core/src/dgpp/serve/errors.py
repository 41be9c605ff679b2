"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the anchor's codes."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException


class APIError(Exception):
    """An error answered to the client; 4xx are ``invalid_request_error``, 5xx ``server_error``."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None, code: str = "invalid_parameter") -> APIError:
    return APIError(400, message, code, param)


def unsupported(param: str, why: str = "is not supported") -> APIError:
    return APIError(400, f"{param} {why}", "unsupported_parameter", param)


def error_response(err: APIError) -> Response:
    return Response(content=msgspec.json.encode(err.body()), status_code=err.status, media_type="application/json")


def handle_api_error(request: Request, exc: APIError) -> Response:
    counters = getattr(request.app.state, "service", None)
    if counters is not None and exc.status < 500:
        counters.rejects_bad += 1
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
    """A bug, not the client's mistake: 500 without internals in the message."""
    import structlog

    structlog.get_logger("dgpp.serve").exception("unhandled error", path=request.url.path)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", "internal_error"))
