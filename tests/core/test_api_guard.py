"""The ASGI stack ``dgpp serve`` listens with (``serving_app``) on a toy engine: every 5xx is logged with its
traceback and the request id, the optional API key guards every route but /health, CORS is off by default."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from structlog.testing import capture_logs
from test_api import sampling_fails

from dgpp.config import EngineConfig, HttpConfig
from dgpp.errors import ConfigError
from dgpp.serve.access import configured_key
from dgpp.serve.app import serving_app
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.testing.toy_backend import build_toy_backend

MODEL = "toy/model"
BODY = {"model": MODEL, "prompt": "Hello world", "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tok_dir = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    engine = build_toy_backend(
        MODEL, tok_dir, EngineConfig(kv_capacity=512, block_size=4, stats_interval_s=0)
    )
    yield engine
    engine.shutdown()


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://dgpp.local"
        ) as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_a_5xx_is_logged_with_its_traceback_and_request_id(engine) -> None:
    app = serving_app(engine, HttpConfig(), max_connections=8)
    with sampling_fails(engine), capture_logs() as logs:
        r = call(
            app,
            "POST",
            "/v1/completions",
            json={**BODY, "temperature": 1.0},
            headers={"X-Request-Id": "probe-500"},
        )
    assert r.status_code == 500 and r.headers["x-request-id"] == "probe-500"
    failed = [e for e in logs if e["event"] == "request failed"]
    assert len(failed) == 1 and failed[0]["request_id"] == "probe-500" and failed[0]["status"] == 500
    assert failed[0]["exc_info"] is not None and failed[0]["completion_id"].startswith("cmpl-")
    sampling = [e for e in logs if e["event"] == "sampling failed"]  # the engine side, with the cause
    assert sampling and isinstance(sampling[0]["exc_info"], ValueError)
    assert sampling[0]["request_id"].startswith(failed[0]["completion_id"])


def test_api_key_guards_every_route_but_health(engine, monkeypatch) -> None:
    app = serving_app(engine, HttpConfig(api_key="s3cret"), max_connections=8)
    assert call(app, "GET", "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = call(app, "POST", "/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert call(app, "GET", "/v1/models").status_code == 401
    ok = call(app, "POST", "/v1/completions", json=BODY, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    monkeypatch.setenv("DGPP_TEST_KEY", "from-env")
    assert configured_key(HttpConfig(api_key_env="DGPP_TEST_KEY")) == "from-env"
    assert configured_key(HttpConfig()) is None
    with pytest.raises(ConfigError, match="DGPP_TEST_UNSET"):
        configured_key(HttpConfig(api_key_env="DGPP_TEST_UNSET"))


def test_cors_is_off_by_default_and_answers_preflights_when_configured(engine) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    plain = serving_app(engine, HttpConfig(), max_connections=8)
    assert (
        "access-control-allow-origin"
        not in call(
            app=plain, method="GET", path="/health", headers={"Origin": "https://app.example"}
        ).headers
    )
    app = serving_app(
        engine, HttpConfig(cors_origins=["https://app.example"], api_key="k"), max_connections=8
    )
    r = call(app, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert r.status_code in (200, 204) and r.headers["access-control-allow-origin"] == "https://app.example"
    r = call(app, "GET", "/health", headers={"Origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"


def test_openapi_document_describes_the_validated_bodies(engine) -> None:
    doc = call(serving_app(engine, HttpConfig(), max_connections=8), "GET", "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = doc["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
    assert {"messages", "model"} <= set(chat["required"])
    assert chat["properties"]["temperature"]["anyOf"][0]["maximum"] == 2.0
    legacy = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"echo", "n", "best_of", "suffix", "user", "skip_special_tokens"} <= set(legacy)
    ref = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "$ref"
    ]
    responses = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"input", "instructions", "previous_response_id", "max_output_tokens"} <= set(
        responses["properties"]
    )
    assert {"get", "delete"} <= set(doc["paths"]["/v1/responses/{response_id}"])
