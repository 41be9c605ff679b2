"""POST /v1/chat/completions and /v1/completions: validate, prepare, submit, then answer once or stream."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream

from dgpp.media.prompt import PromptMedia
from dgpp.sample.params import SamplingParams
from dgpp.sched.request import RetireReason
from dgpp.sched.thread_handoff import GenerationRequest, announced
from dgpp.serve.backend import Backend, RequestHandle
from dgpp.serve.disconnect import DisconnectWatch, client_gone
from dgpp.serve.errors import APIError, invalid, log_error, request_id_of, unsupported
from dgpp.serve.generation import generation_request, named_max_tokens, sampling_params
from dgpp.serve.http_guard import content_length
from dgpp.serve.legacy import LegacyPrompt, best_of, legacy_body, prepare_prompt, score_prompt, split_prompts
from dgpp.serve.openai_format import (
    DONE,
    KEEP_ALIVE,
    ChunkWriter,
    chat_response,
    timings,
)
from dgpp.serve.output_processor import Delta, OutputProcessor
from dgpp.serve.protocol import ChatCompletionRequest, CompletionRequest
from dgpp.serve.validate import check_content_type, check_model, parse_body


def _backend(request: Request) -> Backend:
    return request.app.state.backend


async def _read(request: Request, kind: type) -> tuple[Any, Backend]:
    backend = _backend(request)
    backend.counters.requests_total += 1
    check_content_type(request.scope)
    req, _ = parse_body(await request.body(), kind, request.app.state.allow_unknown_fields)
    check_model(req.model, backend.model_id)
    return req, backend


@post("/v1/chat/completions", status_code=200)
@announced(lambda request: _backend(request).inbox)
async def chat_completions(request: Request) -> Response | Stream:
    req, backend = await _read(request, ChatCompletionRequest)
    params = sampling_params(req, backend.defaults, backend.limits.vocab_size, backend.default_max_tokens)
    prepared = await backend.prepare_chat(req, req.n or 1)
    handle = backend.submit(
        api_request(
            backend,
            "chatcmpl",
            req,
            prepared.prompt_ids,
            params,
            n=req.n or 1,
            matchers=prepared.matchers,
            constraint=prepared.constraint,
            media=prepared.media,
        )
    )
    return await _answer(
        request, backend, handle, req, backend.output_processors(handle, prepared, *_special(req))
    )


def api_request(
    backend: Backend,
    kind: str,
    req: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    n: int,
    matchers: list[Any] | None = None,
    constraint: dict[str, Any] | None = None,
    media: PromptMedia | None = None,
) -> GenerationRequest:
    """The ``GenerationRequest`` of an API request (``serve/generation.py`` decides it)."""
    return generation_request(
        kind,
        prompt_ids,
        params,
        backend.limits,
        named_limit=named_max_tokens(req) is not None,
        token_text=backend.token_text,
        n=n,
        use_prefix_cache=req.prefix_cache,
        matchers=matchers,
        constraint=constraint,
        media=media,
    )


@post("/v1/completions", status_code=200)
@announced(lambda request: _backend(request).inbox)
async def completions(request: Request) -> Response | Stream:
    req, backend = await _read(request, CompletionRequest)
    n = req.n or 1
    generate = req.best_of or n  # best_of > n: generate best_of per prompt, answer with the n most likely
    params = sampling_params(
        req, backend.defaults, backend.limits.vocab_size, backend.default_max_tokens, ranked=generate > n
    )
    split = split_prompts(req.prompt, backend.limits.vocab_size)
    if (
        len(split) > backend.queue_limit
    ):  # each prompt is one queued request: this batch could never be accepted
        raise invalid(
            f"prompt holds {len(split)} prompts, more than this server ever queues at once "
            f"(engine.queue_limit = {backend.queue_limit}); send at most {backend.queue_limit} per "
            "request",
            "prompt",
            "too_many_prompts",
        )
    if req.stream and len(split) > 1:
        raise unsupported("prompt", "holds several prompts, which only a non-streamed request can take")
    prompts = [await prepare_prompt(backend, p) for p in split]
    watch = DisconnectWatch(request)  # one watcher for every sequence this request starts
    try:
        if req.echo and req.logprobs is not None:
            await asyncio.gather(*(score_prompt(backend, p, req.logprobs, watch.track) for p in prompts))
        handles: list[RequestHandle] = []
        for p in prompts if req.max_tokens != 0 and not watch.gone else []:
            handles.append(
                watch.track(backend.submit(api_request(backend, "cmpl", req, p.ids, params, n=generate)))
            )
        outputs = [backend.output_processors(h, None, *_special(req)) for h in handles]
        if req.stream and not watch.gone:
            watch.close()  # from here the stream notices its client leaving (the response closes its generator)
            return await _answer(
                request, backend, handles[0], req, outputs[0], prompts[0] if req.echo else None
            )
        await asyncio.gather(
            *(_collect(request, backend, h, o, watch) for h, o in zip(handles, outputs, strict=True))
        )
    except BaseException:
        watch.cancel_all()
        raise
    finally:
        watch.close()
    if watch.gone:
        raise client_gone()
    body = {
        "id": handles[0].request_id if handles else f"cmpl-{secrets.token_hex(8)}",
        "created": int(time.time()),
        "model": backend.model_id,
        **legacy_body(
            prompts,
            [best_of(o, n) for o in outputs],
            n,
            req.echo,
            req.logprobs is not None,
            generated=[c for o in outputs for c in o],
        ),
    }
    if handles:
        body["timings"] = timings(outputs[0][0])
    return Response(content=msgspec.json.encode(body), media_type="application/json", status_code=200)


def _special(req: Any) -> tuple[bool, bool]:
    return req.skip_special_tokens, req.spaces_between_special_tokens


async def _answer(
    request: Request,
    backend: Backend,
    handle: RequestHandle,
    req: Any,
    outputs: list[OutputProcessor],
    echo: LegacyPrompt | None = None,
) -> Response | Stream:
    chat = isinstance(req, ChatCompletionRequest)
    created = int(time.time())
    if req.stream:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        obfuscate = opts.include_obfuscation if opts is not None else True
        tier = chat and req.service_tier is not None
        writer = ChunkWriter(
            handle.request_id, created, backend.model_id, chat, include_usage, obfuscate, tier
        )
        ping = (
            req.sse_ping_interval
            if req.sse_ping_interval is not None
            else request.app.state.sse_ping_interval
        )
        first = b"".join(writer.echo(o.index, echo.text, echo.logprobs) for o in outputs) if echo else b""
        events = _stream(backend, handle, outputs, writer, ping, first, request)
        return Stream(
            events, media_type="text/event-stream", status_code=200, headers={"Cache-Control": "no-cache"}
        )
    await _collect(request, backend, handle, outputs)  # one-shot legacy requests are answered by the route
    body = chat_response(
        handle.request_id,
        created,
        backend.model_id,
        handle.prompt_tokens,
        outputs,
        handle.request.params.logprobs,
        req.metadata,
        service_tier=req.service_tier is not None,
    )
    body["timings"] = timings(outputs[0])
    return Response(content=msgspec.json.encode(body), media_type="application/json", status_code=200)


async def _collect(
    request: Request,
    backend: Backend,
    handle: RequestHandle,
    outputs: list[OutputProcessor],
    watch: DisconnectWatch | None = None,
    on_delta: Callable[[Delta], Any] | None = None,
) -> None:
    """Drive a one-shot request to its end; a client gone before the answer frees its slots (``watch``: the HTTP
    request's watcher, when it owns several engine requests; ``on_delta`` sees each choice delta)."""
    own = watch is None
    watch = watch or DisconnectWatch(request)
    watch.track(handle)
    try:
        async for item in _drive(handle, outputs, None):
            if on_delta is not None:
                on_delta(item[1])
    finally:
        if own:
            watch.close()
        handle.cancel()
    if own and watch.gone:
        raise client_gone()
    failed = [o for o in outputs if o.finish_reason == "error"]
    if failed:
        backend.counters.requests_failed += 1
        raise _generation_error(backend, handle, failed[0].error)
    backend.counters.finished(outputs)


def _generation_error(backend: Backend, handle: RequestHandle, why: str | None) -> APIError:
    """503 ``engine_failure`` when the step loop stopped on a failure; 500 when only this request's generation
    failed (e.g. its grammar matcher), which is a server fault but leaves the model serving. The scheduler's log
    line with the traceback names the completion id this error's log line carries."""
    failed = backend.inbox.failed
    if failed is not None:
        err = APIError(503, f"engine failed while generating this request: {failed}", "engine_failure")
    else:
        err = APIError(500, f"generation failed: {why}", "generation_failed")
    err.log_fields["completion_id"] = handle.request_id
    return err


async def _drive(
    handle: RequestHandle, outputs: list[OutputProcessor], ping: float | None
) -> AsyncIterator[Any]:
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


async def _stream(
    backend: Backend,
    handle: RequestHandle,
    outputs: list[OutputProcessor],
    writer: ChunkWriter,
    ping: int,
    first: bytes = b"",
    request: Request | None = None,
) -> AsyncIterator[bytes]:
    """The SSE stream of a request's choices; a generation error's log line names ``request``'s id."""
    try:
        if first:
            yield first
        async for item in _drive(handle, outputs, None if ping < 0 else float(ping)):
            if item is None:
                yield KEEP_ALIVE
                continue
            index, delta = item
            if delta.error is not None:
                backend.counters.requests_failed += 1
                err = _generation_error(backend, handle, delta.error)
                log_error(err, request_id_of(request) if request is not None else None, "stream")
                yield writer.delta(index, delta.parts, delta.logprobs, None)
                yield writer.error(err.message, err.code or "engine_failure")
                yield DONE
                return
            last = delta.finish_reason is not None and all(o.finished for o in outputs)
            times = timings(outputs[0]) if last else None
            chunk = writer.delta(index, delta.parts, delta.logprobs, delta.finish_reason, times)
            if chunk:
                yield chunk
        backend.counters.finished(outputs)
        if writer.include_usage:
            yield writer.usage_chunk(handle.prompt_tokens, outputs)
        yield DONE
    finally:
        handle.cancel()  # client disconnect (or any exit): unfinished choices free their slots


def reject_body_too_large(request: Request, max_body_bytes: int) -> None:
    """413 from Content-Length, before the body is read or tokenized. Read from the raw ASGI headers: building
    ``request.headers`` cost more than the rest of this check for every request of a burst."""
    size = content_length(request.scope)
    if size is not None and size > max_body_bytes:
        raise APIError(
            413,
            f"request body of {size} bytes exceeds http.max_body_bytes = {max_body_bytes}",
            "request_too_large",
        )
