"""uvicorn's HTTP protocol with its one plain-text answer replaced: a request the HTTP parser cannot read
(a non-numeric Content-Length, a malformed request line or header) gets a 400 in OpenAI's error shape,
which OpenAI clients can parse, instead of ``Invalid HTTP request received.`` as text."""

from __future__ import annotations

import msgspec
import structlog

from dgpp.serve.errors import APIError

log = structlog.get_logger("dgpp.serve")


def _openai_400(self, msg: str) -> None:  # noqa: ANN001 - a method of either uvicorn protocol
    err = APIError(400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}), e.g. a non-numeric "
                        "Content-Length or a malformed header", "invalid_request")
    body = msgspec.json.encode(err.body())
    log.info("request rejected", status=400, code=err.code, error=msg, client=str(getattr(self, "client", "")))
    self.transport.write(b"".join([
        b"HTTP/1.1 400 Bad Request\r\n",
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
        b"connection: close\r\n\r\n",
        body,
    ]))
    self.transport.close()


def protocol_class() -> type:
    """The protocol uvicorn would pick itself (httptools when installed, else h11), answering bad HTTP in
    OpenAI's error shape."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # httptools is an optional uvicorn dependency
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    return type("OpenAIErrorProtocol", (Base,), {"send_400_response": _openai_400})
