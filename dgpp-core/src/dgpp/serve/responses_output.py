"""A choice's chat deltas -> Responses output items and the stream events that build them.

The chat chain (``OutputProcessor``) already splits the output into ``reasoning_content``, ``content`` and
``tool_calls`` deltas. ``OutputItems`` turns that sequence into output items in the order the model wrote
them (a ``reasoning`` item, a ``message`` item with one ``output_text`` part, a ``function_call`` or
``custom_tool_call`` item per call) and, for a streamed response, into the events OpenAI's Responses stream
sends: ``output_item.added``, ``content_part.added``, the deltas (``reasoning_text``, ``output_text``,
``function_call_arguments``, ``custom_tool_call_input``), their ``.done`` events, ``content_part.done`` and
``output_item.done``. A one-shot response is built by the same code with the events dropped, so both agree.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from dgpp.sample.params import SamplingParams
from dgpp.serve.logprobs import REASONING
from dgpp.serve.output_processor import OutputProcessor
from dgpp.serve.responses_protocol import ResponsesRequest

Event = dict[str, Any]
CALLS = ("function_call", "custom_tool_call")


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class OutputItems:
    """The output items of one response, built from its choice's deltas; ``feed`` and ``finish`` return events."""

    def __init__(self, logprobs: bool) -> None:
        self.items: list[dict[str, Any]] = []
        self.logprobs = logprobs
        self._open: dict[str, Any] | None = None
        self._pending_logprobs: list[dict[str, Any]] = []  # entries of tokens whose text is not out yet

    # ---- per delta ----------------------------------------------------------------------------------------------
    def feed(self, parts: list[dict[str, Any]], logprobs: list[dict[str, Any]]) -> list[Event]:
        self._pending_logprobs += [e for e in logprobs if REASONING not in e]
        events: list[Event] = []
        for part in parts:
            if part.get("reasoning_content"):
                events += self._text("reasoning", part["reasoning_content"])
            elif part.get("content"):
                events += self._text("message", part["content"])
            elif part.get("tool_calls"):
                events += self._call(part["tool_calls"][0])
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """Close the open item (``incomplete``: the output was cut at max_output_tokens). A finished response
        that said nothing and called nothing still gets its (empty) message item, as does any empty output."""
        status = "incomplete" if incomplete else "completed"
        events = self._close(status)
        if not self.items or not incomplete and not any(i["type"] in ("message", *CALLS) for i in self.items):
            events += self._open_message() + self._close(status)
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._open_message() if kind == "message" else self._open_reasoning()
        item = self._open
        assert item is not None
        at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            item["content"][0]["text"] += text
            return [*events, {"type": "response.reasoning_text.delta", **at, "delta": text}]
        part = item["content"][0]
        part["text"] += text
        entries, self._pending_logprobs = self._pending_logprobs, []
        if self.logprobs:
            part["logprobs"] += entries
        return [*events, {"type": "response.output_text.delta", **at, "delta": text, "logprobs": entries}]

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        """A call's first delta (its id and name) opens its item; the second carries the arguments (a custom
        tool's input) whole."""
        custom = "custom" in delta
        if "id" in delta:
            events = self._close("completed")
            if custom:
                item = {
                    "id": item_id("ctc"),
                    "type": "custom_tool_call",
                    "status": "in_progress",
                    "call_id": delta["id"],
                    "name": delta["custom"]["name"],
                    "input": "",
                }
            else:
                item = {
                    "id": item_id("fc"),
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": delta["id"],
                    "name": delta["function"]["name"],
                    "arguments": "",
                }
            return [*events, *self._add(item)]
        item = self._open
        assert item is not None and item["type"] in CALLS
        text = delta["custom"]["input"] if custom else delta["function"]["arguments"]
        item["input" if custom else "arguments"] += text
        kind = "custom_tool_call_input" if custom else "function_call_arguments"
        return [
            {
                "type": f"response.{kind}.delta",
                "item_id": item["id"],
                "output_index": len(self.items) - 1,
                "delta": text,
            }
        ]

    # ---- opening and closing items ------------------------------------------------------------------------------
    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}
        ]

    def _open_message(self) -> list[Event]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = {
            "id": item_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        events = self._add(item)
        item["content"].append(part)
        return [*events, self._part_event("added", item, part)]

    def _open_reasoning(self) -> list[Event]:
        part = {"type": "reasoning_text", "text": ""}
        item = {
            "id": item_id("rs"),
            "type": "reasoning",
            "status": "in_progress",
            "summary": [],
            "content": [],
            "encrypted_content": None,
        }
        events = self._add(item)
        item["content"].append(part)
        return [*events, self._part_event("added", item, part)]

    def _part_event(self, what: str, item: dict[str, Any], part: dict[str, Any]) -> Event:
        return {
            "type": f"response.content_part.{what}",
            "item_id": item["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "part": _copy(part),
        }

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events: list[Event] = []
        if item["type"] == "function_call":
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **at,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        elif item["type"] == "custom_tool_call":
            events.append({"type": "response.custom_tool_call_input.done", **at, "input": item["input"]})
        else:
            part = item["content"][0]
            if item["type"] == "message":
                if self.logprobs:
                    part["logprobs"] += self._pending_logprobs
                self._pending_logprobs = []
                events.append(
                    {
                        "type": "response.output_text.done",
                        **at,
                        "content_index": 0,
                        "text": part["text"],
                        "logprobs": _copy(part["logprobs"]),
                    }
                )
            else:
                events.append(
                    {"type": "response.reasoning_text.done", **at, "content_index": 0, "text": part["text"]}
                )
            events.append(self._part_event("done", item, part))
        item["status"] = status
        return [
            *events,
            {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": _copy(item)},
        ]


def _copy(value: Any) -> Any:
    """A snapshot: an event carries the item as it is now, not as it ends up."""
    return msgspec.json.decode(msgspec.json.encode(value))


def usage(prompt_tokens: int, choice: OutputProcessor) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": choice.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": choice.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens},
        "total_tokens": prompt_tokens + choice.completion_tokens,
    }


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's ``status`` and ``incomplete_details`` for the choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return ("failed" if finish_reason == "error" else "completed"), None


def response_body(
    response_id: str,
    created_at: int,
    model: str,
    req: ResponsesRequest,
    params: SamplingParams,
    status: str,
    output: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """The ``response`` object: the request's settings as served, its status and output (``extra``: usage,
    incomplete_details, error, completed_at when known)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {
            "effort": req.reasoning.effort if req.reasoning else None,
            "summary": req.reasoning.summary if req.reasoning else None,
        },
        "store": req.keeps,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_logprobs": req.top_logprobs,
        "text": {"format": (req.text.format if req.text else None) or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "background": False,
        "service_tier": "default" if req.service_tier is not None else None,
        "usage": None,
        **extra,
    }
