"""``GET /openapi.json``: an OpenAPI 3.1 description of the routes, with request bodies from the same msgspec
Structs that validate them (``dgpp.serve.protocol``), so the document cannot drift from what is enforced.

Litestar's own generator is not used: the routes read their bodies themselves (to answer every validation
failure in OpenAI's error shape), so Litestar sees no body types to describe.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dgpp.serve.protocol import ChatCompletionRequest, CompletionRequest
from dgpp.serve.responses_protocol import ResponsesRequest

_REF = "#/components/schemas/{name}"
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _answers(ok: str) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}}}
    return {
        "200": {"description": ok},
        "4XX": {"description": "the client's mistake", **error},
        "5XX": {"description": "a server fault or overload (503 carries Retry-After)", **error},
    }


def _post(summary: str, body: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF.format(name=body)}}},
            },
            "responses": _answers("a JSON body, or text/event-stream with stream: true"),
        }
    }


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": _answers("a JSON body")}}


def openapi_document(version: str) -> dict[str, Any]:
    (_, _, _), components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ResponsesRequest], ref_template=_REF
    )
    components["Error"] = _ERROR
    return {
        "openapi": "3.1.0",
        "info": {"title": "dgpp OpenAI-compatible API", "version": version},
        "paths": {
            "/v1/chat/completions": _post("Chat completion", "ChatCompletionRequest"),
            "/v1/completions": _post("Legacy text completion", "CompletionRequest"),
            "/v1/responses": _post("Response (OpenAI Responses API)", "ResponsesRequest"),
            "/v1/responses/{response_id}": {
                **_get("A stored response"),
                "delete": {"summary": "Forget a stored response", "responses": _answers("a JSON body")},
            },
            "/v1/responses/{response_id}/input_items": _get(
                "A stored response's input items (limit, order, after)"
            ),
            "/v1/models": _get("The served model"),
            "/v1/models/{model_id}": _get("One model by id"),
            "/health": _get("Liveness (503 once the engine failed); open without the API key"),
            "/metrics": _get("Engine and service counters (JSON)"),
            "/metrics/prometheus": _get("The same counters in Prometheus text format"),
            "/openapi.json": _get("This document"),
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
