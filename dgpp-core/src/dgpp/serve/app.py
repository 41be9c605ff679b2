"""The Litestar application: routes, error handlers, and ``run(cfg)`` (what ``dgpp serve`` calls)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException

from dgpp import __version__
from dgpp.config import DeployConfig
from dgpp.serve.access import ApiKey, configured_key
from dgpp.serve.backend import Backend
from dgpp.serve.completions import chat_completions, completions, reject_body_too_large
from dgpp.serve.errors import APIError, handle_api_error, handle_http_exception, handle_unexpected
from dgpp.serve.http_guard import BodyGuard, ConnectionLimit
from dgpp.serve.metrics import PrometheusExport, metrics_json
from dgpp.serve.openapi import openapi_document
from dgpp.serve.responses import create_response, delete_response, get_response, list_input_items
from dgpp.serve.responses_store import ResponseStore


def _json(body: Any, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(body), media_type="application/json", status_code=status)


def model_object(backend: Backend) -> dict[str, Any]:
    lim = backend.limits
    tools = backend.chat_template is not None and backend.dialect is not None  # a dialect parses calls back
    return {
        "id": backend.model_id,
        "object": "model",
        "created": backend.created,
        "owned_by": "dgpp",
        "sampling": {"available": True, "defaults": dict(backend.sampling_defaults)},
        "tools": {"available": tools, "constrained": tools and backend.grammar is not None},
        "response_format": {
            "json_object": backend.grammar is not None,
            "json_schema": backend.grammar is not None,
        },
        "reasoning": {"in_content": backend.reasoning_in_content, "effort_mapping": backend.effort_mapping},
        "default_chat_template_kwargs": dict(getattr(backend.chat_template, "default_kwargs", {}) or {}),
        "input_modalities": ["text", "image"] if backend.images is not None else ["text"],
        "context": {
            "request_limit_tokens": lim.request_limit_tokens,
            "position_ceiling_tokens": lim.max_position,
            "kv_pool_tokens": lim.kv_pool_tokens,
            "limited_by": "position-ceiling" if lim.max_position <= lim.kv_pool_tokens else "kv-pool",
        },
    }


@get("/v1/models")
async def list_models(request: Request) -> Response:
    return _json({"object": "list", "data": [model_object(request.app.state.backend)]})


@get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    backend: Backend = request.app.state.backend
    model_id = model_id.lstrip("/")
    if model_id != backend.model_id:
        raise APIError(
            404,
            f"model {model_id!r} is not served here (this server serves {backend.model_id!r})",
            "model_not_found",
            "model",
        )
    return _json(model_object(backend))


@get("/health")
async def health(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    failed = backend.inbox.failed
    if failed is not None:
        return _json({"status": "failed", "model": backend.model_id, "error": failed}, 503)
    return _json({"status": "ok", "model": backend.model_id})


@get(["/metrics", "/v1/metrics"])
async def metrics(request: Request) -> Response:
    return _json(metrics_json(request.app.state.backend))


@get("/openapi.json")
async def openapi_json(request: Request) -> Response:
    return _json(request.app.state.openapi)


@get("/metrics/prometheus")
async def metrics_prometheus(request: Request) -> Response:
    return Response(
        content=request.app.state.prometheus.text(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


def build_app(
    backend: Backend,
    max_body_bytes: int = 16777216,
    sse_ping_interval: int = 30,
    cors_origins: list[str] | None = None,
    responses_store_bytes: int = 67108864,
    allow_unknown_fields: bool = False,
) -> Litestar:
    """An app serving ``backend``; its step loop must already be started. ``serving_app`` adds the ASGI
    wrappers a listening server needs (request ids, body deadline, API key, connection limit)."""

    async def body_limit(request: Request) -> None:
        if request.method == "POST":
            reject_body_too_large(request, max_body_bytes)

    app = Litestar(
        route_handlers=[
            chat_completions,
            completions,
            create_response,
            get_response,
            delete_response,
            list_input_items,
            list_models,
            get_model,
            health,
            metrics,
            metrics_prometheus,
            openapi_json,
        ],
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
        before_request=body_limit,
        request_max_body_size=max_body_bytes,
        on_shutdown=[lambda: backend.shutdown()],
        openapi_config=None,
        cors_config=CORSConfig(allow_origins=list(cors_origins)) if cors_origins else None,
    )
    app.state.backend = backend
    app.state.prometheus = PrometheusExport(backend)
    app.state.service = backend.counters
    app.state.sse_ping_interval = sse_ping_interval
    app.state.allow_unknown_fields = allow_unknown_fields
    app.state.openapi = openapi_document(__version__)
    app.state.responses = ResponseStore(responses_store_bytes)
    return app


def serving_app(backend: Backend, http_cfg: Any, max_connections: int) -> Any:
    """The ASGI application ``dgpp serve`` listens with: request id, API key and a deadline-bound body read
    (``BodyGuard``), then ``engine.max_connections`` (``ConnectionLimit``), then the routes."""
    app = build_app(
        backend,
        http_cfg.max_body_bytes,
        http_cfg.sse_ping_interval,
        list(http_cfg.cors_origins),
        http_cfg.responses_store_bytes,
        http_cfg.allow_unknown_fields,
    )

    def shed() -> None:
        backend.inbox.shed()
        backend.counters.requests_total += 1

    key = configured_key(http_cfg)
    limited = ConnectionLimit(app, max_connections, on_reject=shed)
    return BodyGuard(limited, http_cfg.max_body_bytes, http_cfg.body_timeout_s, ApiKey(key) if key else None)


def run(cfg: DeployConfig, backend: Backend) -> None:
    """Serve ``backend`` (``dgpp.server_assembly.build_backend``; rank 0's under TP) with uvicorn until
    interrupted (``dgpp serve CONFIG``)."""
    import uvicorn

    from dgpp.serve.http_protocol import protocol_class
    from dgpp.serve.warmup import warm_up

    if cfg.engine.warmup and backend.compiles_kernels:  # the first bursts' kernel compiles, before listening
        warm_up(backend, cfg.engine.max_concurrency)
    asgi = serving_app(backend, cfg.http, cfg.engine.max_connections)
    protocol = protocol_class(cfg.http.max_header_bytes, cfg.http.header_timeout_s)
    uvicorn.run(asgi, host=cfg.http.bind_host, port=cfg.http.port, log_level="warning", http=protocol)
