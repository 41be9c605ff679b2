"""The Litestar application: routes, error handlers, and ``run(cfg)`` (what ``dgpp serve`` calls)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Litestar, Request, Response, get
from litestar.exceptions import HTTPException

from dgpp.config import DeployConfig
from dgpp.serve.backend import ServingEngine
from dgpp.serve.completions import chat_completions, completions, reject_body_too_large
from dgpp.serve.connections import ConnectionLimit
from dgpp.serve.errors import APIError, handle_api_error, handle_http_exception, handle_unexpected
from dgpp.serve.metrics import PrometheusExport, metrics_json

if TYPE_CHECKING:
    from dgpp.preflight import Deployment


def _json(body: Any, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(body), media_type="application/json", status_code=status)


def model_object(engine: ServingEngine) -> dict[str, Any]:
    lim = engine.limits
    return {
        "id": engine.model_id, "object": "model", "created": engine.created, "owned_by": "dgpp",
        "sampling": {"available": True, "defaults": engine.defaults.as_dict()},
        "tools": {"available": engine.chat_template is not None, "constrained": engine.grammar is not None},
        "response_format": {"json_object": engine.grammar is not None, "json_schema": engine.grammar is not None},
        "reasoning": {"in_content": engine.reasoning_in_content, "effort_mapping": _effort_mapping(engine)},
        "default_chat_template_kwargs": dict(getattr(engine.chat_template, "default_kwargs", {}) or {}),
        "input_modalities": ["text"],
        "context": {
            "request_limit_tokens": lim.request_limit_tokens, "position_ceiling_tokens": lim.max_position,
            "kv_pool_tokens": lim.kv_pool_tokens,
            "limited_by": "position-ceiling" if lim.max_position <= lim.kv_pool_tokens else "kv-pool",
        },
    }


def _effort_mapping(engine: ServingEngine) -> dict[str, Any]:
    if engine.chat_template is None:
        return {}
    try:
        return engine.chat_template.effort_mapping()
    except Exception:  # a template without the mapping's variables maps nothing
        return {}


@get("/v1/models")
async def list_models(request: Request) -> Response:
    return _json({"object": "list", "data": [model_object(request.app.state.engine)]})


@get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    engine: ServingEngine = request.app.state.engine
    model_id = model_id.lstrip("/")
    if model_id != engine.model_id:
        raise APIError(404, f"model {model_id!r} is not served here (this server serves {engine.model_id!r})",
                       "model_not_found", "model")
    return _json(model_object(engine))


@get("/health")
async def health(request: Request) -> Response:
    engine: ServingEngine = request.app.state.engine
    if engine.loop.failed is not None:
        return _json({"status": "failed", "model": engine.model_id, "error": engine.loop.failed}, 503)
    return _json({"status": "ok", "model": engine.model_id})


@get(["/metrics", "/v1/metrics"])
async def metrics(request: Request) -> Response:
    return _json(metrics_json(request.app.state.engine))


@get("/metrics/prometheus")
async def metrics_prometheus(request: Request) -> Response:
    return Response(content=request.app.state.prometheus.text(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


def build_app(engine: ServingEngine, max_body_bytes: int = 268435456, sse_ping_interval: int = 30) -> Litestar:
    """An app serving ``engine``; the engine loop must already be started."""
    if not engine.created:
        engine.created = int(time.time())

    async def body_limit(request: Request) -> None:
        if request.method == "POST":
            reject_body_too_large(request, max_body_bytes)

    app = Litestar(
        route_handlers=[chat_completions, completions, list_models, get_model, health, metrics, metrics_prometheus],
        exception_handlers={APIError: handle_api_error, HTTPException: handle_http_exception,
                            Exception: handle_unexpected},
        before_request=body_limit,
        request_max_body_size=max_body_bytes,
        on_shutdown=[lambda: engine.shutdown()],
        openapi_config=None,
    )
    app.state.engine = engine
    app.state.prometheus = PrometheusExport(engine)
    app.state.service = engine.counters
    app.state.sse_ping_interval = sse_ping_interval
    return app


def run(cfg: DeployConfig, engine: ServingEngine | None = None, deployment: Deployment | None = None) -> None:
    """Load the deployment's model (or take ``engine``, rank 0's under TP) and serve it with uvicorn
    until interrupted (``dgpp serve CONFIG``); ``deployment`` is preflight's resolution, reused."""
    import uvicorn

    from dgpp.serve.build import build_serving_engine

    engine = engine or build_serving_engine(cfg, deployment)
    app = build_app(engine, cfg.http.max_body_bytes, cfg.http.sse_ping_interval)

    def shed() -> None:
        engine.loop.requests_shed += 1
        engine.counters.requests_total += 1

    limited = ConnectionLimit(app, cfg.engine.max_connections, on_reject=shed)
    uvicorn.run(limited, host=cfg.http.bind_host, port=cfg.http.port, log_level="warning")
