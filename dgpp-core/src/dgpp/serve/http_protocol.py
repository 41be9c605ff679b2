"""uvicorn's HTTP protocol (httptools) with what a public listener needs before any ASGI code runs:

- a request the HTTP parser cannot read (a non-numeric Content-Length, a malformed request line or header)
  gets a 400 in OpenAI's error shape, which OpenAI clients can parse, instead of ``Invalid HTTP request
  received.`` as text;
- the request line and headers are at most ``http.max_header_bytes`` (431 past it): the parser buffers an
  unfinished header whole, so without a limit 16 connections each sending 64 MB of one header held 1.1 GB;
- they must arrive within ``http.header_timeout_s`` of the connection opening (or of a kept-alive connection's
  next request starting), else 408 and the connection closes: a client trickling a header forever costs
  nothing past the deadline. The body has its own deadline (``http_guard.BodyGuard``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dgpp.serve.errors import APIError

log = structlog.get_logger("dgpp.serve")


class GuardedHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with OpenAI-shaped parser errors, a header size limit and a header deadline (the
    class attributes are set per server by ``protocol_class``)."""

    max_header_bytes = 65536
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request line and headers (from the connection's start)
        self._head_bytes = 0
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # checked after the parser had the data: a chunk that ends the headers (and carries some body) is fine
        if self._in_head and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._refuse(
                431,
                f"the request line and headers exceed http.max_header_bytes = {self.max_header_bytes}",
                "request_header_fields_too_large",
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._head_deadline is None:
            self._arm_deadline()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0  # what follows is the next request's head (keep-alive idles
        # between requests are uvicorn's timeout_keep_alive; the deadline restarts at the next request's first byte)

    def send_400_response(self, msg: str) -> None:
        self._refuse(
            400,
            f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}), e.g. a non-numeric "
            "Content-Length or a malformed header",
            "invalid_request",
            parser_error=msg,
        )

    def _arm_deadline(self) -> None:
        self._disarm_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._answering():  # a pipelined request's head: its deadline waits for the answer before it
            self._arm_deadline()
            return
        self._refuse(
            408,
            f"the request line and headers did not arrive within http.header_timeout_s = "
            f"{self.header_timeout_s:g} s",
            "request_timeout",
        )

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, message: str, code: str, parser_error: str | None = None) -> None:
        """Answer in OpenAI's error shape and close the connection (what is left of the request is unread)."""
        self._disarm_deadline()
        if self._answering():  # an earlier request's answer is being written: no room for another, just close
            log.info("connection closed", status=status, code=code, error=message, client=str(self.client))
            self.transport.close()
            return
        err = APIError(status, message, code)
        body = msgspec.json.encode(err.body())
        log.info(
            "request rejected",
            status=status,
            code=code,
            error=parser_error or message,
            client=str(self.client),
        )
        reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[
            status
        ]
        self.transport.write(
            b"".join(
                [
                    b"HTTP/1.1 %d %s\r\n" % (status, reason),
                    b"content-type: application/json\r\n",
                    b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                    b"connection: close\r\n\r\n",
                    body,
                ]
            )
        )
        self.transport.close()


def protocol_class(max_header_bytes: int = 65536, header_timeout_s: float = 10.0) -> type:
    """The protocol ``dgpp serve`` listens with, for one server's limits."""
    return type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s},
    )
