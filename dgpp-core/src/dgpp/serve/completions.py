"""POST /v1/chat/completions and /v1/completions: validate, prepare, submit, then answer once or stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream

from dgpp.sched.request import RetireReason
from dgpp.serve.backend import Backend, RequestHandle
from dgpp.serve.choice_output import ServedChoice
from dgpp.serve.errors import APIError, invalid
from dgpp.serve.openai_format import (
    DONE,
    KEEP_ALIVE,
    ChunkWriter,
    chat_response,
    completion_response,
    timings,
)
from dgpp.serve.protocol import ChatCompletionRequest, CompletionRequest
from dgpp.serve.validate import check_model, parse_body, sampling_params


def _backend(request: Request) -> Backend:
    return request.app.state.backend


async def _read(request: Request, kind: type) -> tuple[Any, dict[str, Any], Backend]:
    backend = _backend(request)
    backend.counters.requests_total += 1
    req, raw = parse_body(await request.body(), kind)
    check_model(req.model, backend.model_id)
    return req, raw, backend


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response | Stream:
    req, raw, backend = await _read(request, ChatCompletionRequest)
    params = sampling_params(req, raw, backend.defaults, backend.limits.vocab_size, backend.default_max_tokens)
    prepared = await backend.prepare_chat(req, req.n or 1)
    if prepared.matchers:  # a grammar ends with EOS: it cannot be ignored
        params = replace(params, ignore_eos=False)
    handle = backend.start(prepared.prompt_ids, params, n=req.n or 1, use_prefix_cache=req.prefix_cache,
                          kind="chatcmpl", matchers=prepared.matchers, constraint=prepared.constraint,
                          max_tokens_given=req.max_tokens is not None or req.max_completion_tokens is not None)
    return await _answer(request, backend, handle, req, backend.text_outputs(handle, prepared))


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response | Stream:
    req, raw, backend = await _read(request, CompletionRequest)
    params = sampling_params(req, raw, backend.defaults, backend.limits.vocab_size, backend.default_max_tokens)
    prompt = await backend.prepare_text(req.prompt)
    handle = backend.start(prompt, params, n=1, use_prefix_cache=req.prefix_cache, kind="cmpl",
                          max_tokens_given=req.max_tokens is not None)
    return await _answer(request, backend, handle, req, backend.text_outputs(handle, None))


async def _answer(request: Request, backend: Backend, handle: RequestHandle, req: Any,
                  outputs: list[ServedChoice]) -> Response | Stream:
    chat = isinstance(req, ChatCompletionRequest)
    created = int(time.time())
    if req.stream:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        obfuscate = opts.include_obfuscation if opts is not None else True
        tier = chat and req.service_tier is not None
        writer = ChunkWriter(handle.request_id, created, backend.model_id, chat, include_usage, obfuscate, tier)
        ping = req.sse_ping_interval if req.sse_ping_interval is not None else request.app.state.sse_ping_interval
        return Stream(_stream(backend, handle, outputs, writer, ping), media_type="text/event-stream",
                      status_code=200, headers={"Cache-Control": "no-cache"})
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, handle))
    try:
        async for _ in _drive(handle, outputs, None):
            pass
    finally:
        watcher.cancel()
        handle.cancel()  # a client gone before the answer frees its slots
    failed = [o for o in outputs if o.finish_reason == "error"]
    if failed:
        backend.counters.requests_failed += 1
        raise _generation_error(backend, failed[0].error)
    backend.counters.finished(outputs)
    if chat:
        body = chat_response(handle.request_id, created, backend.model_id, len(handle.prompt_ids), outputs,
                             handle.params.logprobs, req.metadata, service_tier=req.service_tier is not None)
    else:
        body = completion_response(handle.request_id, created, backend.model_id, len(handle.prompt_ids), outputs,
                                   handle.params.logprobs)
    body["timings"] = timings(handle.seqs[0], outputs[0].completion_tokens)
    return Response(content=msgspec.json.encode(body), media_type="application/json", status_code=200)


def _generation_error(backend: Backend, why: str | None) -> APIError:
    """503 ``engine_failure`` when the step loop stopped on a failure; 500 when only this request's generation
    failed (e.g. its grammar matcher), which is a server fault but leaves the model serving."""
    if backend.loop.failed is not None:
        return APIError(503, f"engine failed while generating this request: {backend.loop.failed}", "engine_failure")
    return APIError(500, f"generation failed: {why}", "generation_failed")


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """A one-shot request whose client hangs up stops generating (the body was read, so the next ASGI
    message can only be the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


async def _drive(handle: RequestHandle, outputs: list[ServedChoice], ping: float | None) -> AsyncIterator[Any]:
    """Yield ``(choice, Delta)`` as events arrive (``None`` after ``ping`` seconds of silence) until every choice ends."""
    while not all(o.finished for o in outputs):
        try:
            if ping is None:
                index, ev = await handle.queue.get()
            else:
                index, ev = await asyncio.wait_for(handle.queue.get(), timeout=ping)
        except TimeoutError:
            yield None
            continue
        if ev.retired is not None:
            handle.done.add(index)
        delta = outputs[index].feed(ev)
        if delta.stopped_by_string:
            handle.cancel(index, RetireReason.STOP)
        yield index, delta


async def _stream(backend: Backend, handle: RequestHandle, outputs: list[ServedChoice], writer: ChunkWriter,
                  ping: int) -> AsyncIterator[bytes]:
    try:
        async for item in _drive(handle, outputs, None if ping < 0 else float(ping)):
            if item is None:
                yield KEEP_ALIVE
                continue
            index, delta = item
            if delta.error is not None:
                backend.counters.requests_failed += 1
                err = _generation_error(backend, delta.error)
                yield writer.delta(index, delta.parts, delta.logprobs, None)
                yield writer.error(err.message, err.code or "engine_failure")
                yield DONE
                return
            last = delta.finish_reason is not None and all(o.finished for o in outputs)
            times = timings(handle.seqs[0], outputs[0].completion_tokens) if last else None
            chunk = writer.delta(index, delta.parts, delta.logprobs, delta.finish_reason, times)
            if chunk:
                yield chunk
        backend.counters.finished(outputs)
        if writer.include_usage:
            yield writer.usage_chunk(len(handle.prompt_ids), outputs)
        yield DONE
    finally:
        handle.cancel()  # client disconnect (or any exit): unfinished choices free their slots


def reject_body_too_large(request: Request, max_body_bytes: int) -> None:
    """413 from Content-Length, before the body is read or tokenized."""
    length = request.headers.get("content-length")
    if length is None:
        return
    try:
        size = int(length)
    except ValueError:
        raise invalid("Content-Length is not a number", None) from None
    if size > max_body_bytes:
        raise APIError(413, f"request body of {size} bytes exceeds http.max_body_bytes = {max_body_bytes}",
                       "request_too_large")
