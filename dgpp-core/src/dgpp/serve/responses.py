"""``POST /v1/responses`` (OpenAI's Responses API), served by the chat route's machinery; ``GET`` and
``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` for stored responses.

A Responses request becomes a chat request (``responses_input``): the same template rendering, tool
dialect, reasoning split, constrained tool calls and sampling. Its one choice's deltas become output items
and stream events (``responses_output``). A stored response (``store`` not false) keeps its conversation in
the server's memory (``responses_store``) for a later ``previous_response_id``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.response import Stream

from dgpp.sample.params import SamplingParams
from dgpp.sched.thread_handoff import announced
from dgpp.serve.backend import Backend, RequestHandle
from dgpp.serve.completions import _collect, _drive, _generation_error, api_request
from dgpp.serve.errors import APIError, invalid, log, log_error, request_id_of
from dgpp.serve.generation import sampling_params
from dgpp.serve.openai_format import KEEP_ALIVE
from dgpp.serve.output_processor import Delta, OutputProcessor
from dgpp.serve.protocol import ChatCompletionRequest
from dgpp.serve.responses_input import chat_body, chat_messages, check_request, input_items, renamed
from dgpp.serve.responses_output import OutputItems, item_id, response_body, status_of, usage
from dgpp.serve.responses_protocol import ResponsesRequest
from dgpp.serve.responses_store import ResponseStore
from dgpp.serve.validate import (
    check_content_type,
    check_model,
    convert,
    decode_json,
    parse_body,
)


def _json(body: Any) -> Response:
    return Response(content=msgspec.json.encode(body), media_type="application/json", status_code=200)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@post("/v1/responses", status_code=200)
@announced(lambda request: request.app.state.backend.inbox)
async def create_response(request: Request) -> Response | Stream:
    backend: Backend = request.app.state.backend
    backend.counters.requests_total += 1
    check_content_type(request.scope)
    req = convert(decode_json(await request.body()), ResponsesRequest)
    check_model(req.model, backend.model_id)
    check_request(req)
    earlier = _earlier(_store(request), req.previous_response_id)
    items = input_items(req)
    try:
        messages = chat_messages(earlier + items, first_input=len(earlier), model=req.model)
        chat, _ = parse_body(msgspec.json.encode(chat_body(req, messages)), ChatCompletionRequest)
        params = sampling_params(
            chat, backend.defaults, backend.limits.vocab_size, backend.default_max_tokens
        )
        prepared = await backend.prepare_chat(chat, 1)
        handle = backend.submit(
            api_request(
                backend,
                "resp",
                chat,
                prepared.prompt_ids,
                params,
                n=1,
                matchers=prepared.matchers,
                constraint=prepared.constraint,
            )
        )
    except APIError as e:
        raise renamed(e) from None
    choice = backend.output_processors(
        handle, prepared, chat.skip_special_tokens, chat.spaces_between_special_tokens
    )[0]
    run = ResponseRun(
        backend, _store(request), req, handle, choice, earlier + [_input_item(i) for i in items]
    )
    if req.stream:
        ping = (
            req.sse_ping_interval
            if req.sse_ping_interval is not None
            else request.app.state.sse_ping_interval
        )
        return Stream(
            run.events(ping, request_id_of(request)),
            media_type="text/event-stream",
            status_code=200,
            headers={"Cache-Control": "no-cache"},
        )
    await _collect(request, backend, handle, [choice], on_delta=run.feed)
    return _json(run.finish()[1])


def _earlier(store: ResponseStore, previous_id: str | None) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` continues (none without one); 400 when it is not stored."""
    if previous_id is None:
        return []
    conversation = store.conversation(previous_id)
    if conversation is None:
        raise APIError(
            400,
            f"previous response {previous_id!r} is not stored here (it was made with store: false, "
            "dropped for http.responses_store_bytes, or made before the server restarted)",
            "previous_response_not_found",
            "previous_response_id",
        )
    return conversation


@get("/v1/responses/{response_id:str}")
async def get_response(request: Request, response_id: str) -> Response:
    body = _store(request).response(response_id)
    if body is None:
        raise _not_found(response_id)
    return _json(body)


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(request: Request, response_id: str) -> Response:
    if not _store(request).delete(response_id):
        raise _not_found(response_id)
    return _json({"id": response_id, "object": "response", "deleted": True})


@get("/v1/responses/{response_id:str}/input_items")
async def list_input_items(request: Request, response_id: str) -> Response:
    """The items a stored response answered (its chain's earlier items and its own input), a page at a time:
    ``limit`` 1-100 (20), ``order`` desc (newest first, the default) or asc, ``after`` an item id."""
    store = _store(request)
    body, conversation = store.response(response_id), store.conversation(response_id)
    if body is None or conversation is None:
        raise _not_found(response_id)
    query = request.query_params
    limit, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise invalid(f"limit {limit!r} is not an integer from 1 to 100", "limit")
    if order not in ("asc", "desc"):
        raise invalid(f"order {order!r} is not asc or desc", "order")
    inputs = conversation[: len(conversation) - len(body["output"])]
    inputs = inputs[::-1] if order == "desc" else inputs
    start = 0
    if after is not None:
        ids = [i.get("id") for i in inputs]
        if after not in ids:
            raise invalid(f"after {after!r} is not an input item of this response", "after")
        start = ids.index(after) + 1
    page = inputs[start : start + int(limit)]
    return _json(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + int(limit) < len(inputs),
        }
    )


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} is not stored here", "not_found", "response_id")


class ResponseRun:
    """One response being generated: its output items, its final body, and storing it."""

    def __init__(
        self,
        backend: Backend,
        store: ResponseStore,
        req: ResponsesRequest,
        handle: RequestHandle,
        choice: OutputProcessor,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.backend, self.store, self.req, self.handle, self.choice = backend, store, req, handle, choice
        self.conversation = conversation
        self.id = "resp_" + handle.request_id.split("-", 1)[1]
        self.created = int(time.time())
        self.items = OutputItems(handle.request.params.logprobs)
        self._sequence = itertools.count()

    @property
    def params(self) -> SamplingParams:
        return self.handle.request.params

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        return self.items.feed(delta.parts, delta.logprobs)

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final body, stored unless the request said ``store: false``."""
        status, incomplete = status_of(self.choice.finish_reason)
        events = self.items.finish(incomplete is not None)
        body = response_body(
            self.id,
            self.created,
            self.backend.model_id,
            self.req,
            self.params,
            status,
            self.items.items,
            usage=usage(self.handle.prompt_tokens, self.choice),
            incomplete_details=incomplete,
            completed_at=int(time.time()),
        )
        if self.req.keeps:
            kept = self.store.put(
                self.id, body, self.conversation + [_history_item(i) for i in self.items.items]
            )
            if not kept:  # a later previous_response_id to it gets the 400 that says why
                log.info(
                    "response not stored: larger than http.responses_store_bytes",
                    response_id=self.id,
                    store_bytes=self.store.max_bytes,
                )
        return events, body

    def _event(self, event: dict[str, Any]) -> bytes:
        data = msgspec.json.encode({**event, "sequence_number": next(self._sequence)})
        return b"event: " + event["type"].encode() + b"\ndata: " + data + b"\n\n"

    async def events(self, ping: int, request_id: str | None) -> AsyncIterator[bytes]:
        """The Responses stream: created, in_progress, the items' events, then completed (or incomplete, or
        failed when generation failed)."""
        try:
            start = response_body(
                self.id, self.created, self.backend.model_id, self.req, self.params, "in_progress", []
            )
            yield self._event({"type": "response.created", "response": start})
            yield self._event({"type": "response.in_progress", "response": start})
            async for item in _drive(self.handle, [self.choice], None if ping < 0 else float(ping)):
                if item is None:
                    yield KEEP_ALIVE
                    continue
                delta = item[1]
                if delta.error is not None:
                    self.backend.counters.requests_failed += 1
                    err = _generation_error(self.backend, self.handle, delta.error)
                    log_error(err, request_id, "stream")
                    failed = response_body(
                        self.id,
                        self.created,
                        self.backend.model_id,
                        self.req,
                        self.params,
                        "failed",
                        self.items.items,
                        error={"code": err.code or "server_error", "message": err.message},
                    )
                    yield self._event({"type": "response.failed", "response": failed})
                    return
                for event in self.feed(delta):
                    yield self._event(event)
            events, body = self.finish()
            for event in events:
                yield self._event(event)
            self.backend.counters.finished([self.choice])
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield self._event({"type": kind, "response": body})
        finally:
            self.handle.cancel()  # client disconnect (or any exit): an unfinished choice frees its slot


ITEM_ID_PREFIX = {
    "message": "msg",
    "reasoning": "rs",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
}


def _input_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the conversation keeps it: with an id, a message's content as parts (what
    ``input_items`` lists; the prompt it renders to is the same)."""
    kind = item.get("type", "message")
    out = {**item, "type": kind, "id": item.get("id") or item_id(ITEM_ID_PREFIX[kind])}
    if kind == "message":
        out.setdefault("status", "completed")
        if isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": item["content"]}]
    return out


def _history_item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the conversation keeps it: what a later turn's prompt needs, without logprobs."""
    if item["type"] == "message":
        return {
            "id": item["id"],
            "type": "message",
            "role": "assistant",
            "status": item["status"],
            "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]],
        }
    if item["type"] == "reasoning":
        return {"id": item["id"], "type": "reasoning", "summary": [], "content": item["content"]}
    return {k: item[k] for k in ("id", "type", "call_id", "name", "arguments", "input") if k in item}
