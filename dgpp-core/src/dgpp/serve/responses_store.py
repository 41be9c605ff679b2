"""Stored Responses (``store`` not false) in the server's memory, for ``previous_response_id`` and
``GET /v1/responses/{id}``.

Each entry holds the response body and its whole conversation as input items (the chain's earlier items, the
request's input, the response's output), encoded as JSON: its size is what it costs. The store keeps the
newest entries within ``http.responses_store_bytes``; older ones are dropped first, and an entry larger than
the whole budget is not kept. Nothing survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response`` and ``conversation``; False when the entry alone exceeds the budget."""
        entry = msgspec.json.encode({"response": response, "conversation": conversation})
        if len(entry) > self.max_bytes:
            return False
        self._drop(response_id)
        self._entries[response_id] = entry
        self._bytes += len(entry)
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def response(self, response_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else msgspec.json.decode(entry)["response"]

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """Every item of the conversation up to and including ``response_id``'s output."""
        entry = self._entries.get(response_id)
        return None if entry is None else msgspec.json.decode(entry)["conversation"]

    def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= len(entry)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes
