"""Stop every sequence of a one-shot request whose client hung up.

One HTTP request can own several engine requests: a legacy completion's prompts (one each), ``n`` choices, and
the forced walks that score prompts for ``echo`` with ``logprobs`` before any generation starts. The handler
keeps running after a client leaves (nothing cancels it), so one watcher per HTTP request listens for the
disconnect and cancels all of them, including any started later; the handler asks ``gone`` before starting
more work.
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request

from dgpp.serve.errors import APIError


def client_gone() -> APIError:
    """What a handler ends with once its client left (logged with the request id; nobody reads the answer)."""
    return APIError(499, "the client closed the connection before the answer", "client_closed_request")


class DisconnectWatch:
    """Listens for ``http.disconnect`` on ``request`` (its body already read, so that is the only message left)."""

    def __init__(self, request: Request) -> None:
        self.gone = False
        self._handles: list[Any] = []
        self._task = asyncio.ensure_future(self._watch(request))

    def track(self, handle: Any) -> Any:
        """Cancel ``handle`` (a ``RequestHandle``) with the others when the client leaves; at once if it has."""
        self._handles.append(handle)
        if self.gone:
            handle.cancel()
        return handle

    async def _watch(self, request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                for handle in self._handles:
                    handle.cancel()
                return

    def cancel_all(self) -> None:
        """Cancel every tracked handle (the handler failed part-way: nothing it started may keep running)."""
        for handle in self._handles:
            handle.cancel()

    def close(self) -> None:
        """Stop listening (the answer is about to be sent, or a stream takes over watching)."""
        self._task.cancel()
