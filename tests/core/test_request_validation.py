"""Request validation edge cases found in review: client mistakes are 400s naming the field, never 500s."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
from litestar.testing import TestClient

from dgpp.config import EngineConfig
from dgpp.serve.app import build_app
from dgpp.serve.errors import APIError
from dgpp.serve.protocol import ChatCompletionRequest
from dgpp.serve.validate import parse_body
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.testing.toy_backend import build_toy_backend


@contextmanager
def _toy_client(
    tmp_path, max_body_bytes: int = 1 << 20, template: Any = None, model_vocab: int | None = None
) -> Iterator[TestClient]:
    engine = build_toy_backend(
        "toy/model", build_tiny_tokenizer(tmp_path), EngineConfig(kv_capacity=1024, stats_interval_s=0)
    )
    if template is not None:
        engine.chat_template = template
    if model_vocab is not None:  # a model with fewer embedding rows than the tokenizer has ids
        engine.limits = replace(engine.limits, vocab_size=model_vocab)
    try:
        with TestClient(app=build_app(engine, max_body_bytes=max_body_bytes)) as client:
            yield client
    finally:
        engine.shutdown()


def _refused(body: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_body(body, ChatCompletionRequest)
    return info.value


def test_deeply_nested_body_is_a_400_not_a_recursion_error() -> None:
    depth = 5000  # past the decoder's recursion limit
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": ' + b"[" * depth
    body += b"]" * depth + b"}"
    err = _refused(body)
    assert err.status == 400 and "too deeply" in err.message


def test_tool_parameters_that_are_not_a_schema_object_are_refused() -> None:
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
        b' "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}'
    )
    err = _refused(body)
    assert err.status == 400 and err.param == "tools[0]" and "parameters" in err.message
    ok = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
        b' "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}'
    )
    assert parse_body(ok, ChatCompletionRequest)[0].tools[0]["function"]["name"] == "f"


def test_chunked_body_past_the_limit_is_request_too_large(tmp_path) -> None:
    def chunks():  # a generator body goes out chunked: no Content-Length for the early check to read
        yield b'{"model": "toy/model", "messages": [{"role": "user", "content": "'
        for _ in range(5):
            yield b"a" * 10000
        yield b'"}]}'

    with _toy_client(tmp_path, max_body_bytes=20000) as client:
        r = client.post(
            "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert r.status_code == 413
    assert (
        r.json()["error"]["code"] == "request_too_large" and "max_body_bytes" in r.json()["error"]["message"]
    )


def test_a_chat_template_that_renders_nothing_is_a_400_not_an_engine_step(tmp_path) -> None:
    # an empty render is the request's problem; a model step of zero tokens would fail the engine
    class RendersNothing:
        default_kwargs: dict = {}

        def render(self, *args, **kwargs) -> str:
            return ""

        def effort_mapping(self) -> dict:
            return {}

    with _toy_client(tmp_path, template=RendersNothing()) as client:
        r = client.post(
            "/v1/chat/completions",
            json={"model": "toy/model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "empty" in r.json()["error"]["message"]


def test_a_prompt_token_past_the_model_vocabulary_is_a_400(tmp_path) -> None:
    # the tiny tokenizer's specials sit at its top ids; a 400-row model cannot embed them
    with _toy_client(tmp_path, model_vocab=400) as client:
        ok = client.post("/v1/completions", json={"model": "toy/model", "prompt": "hello", "max_tokens": 2})
        bad = client.post(
            "/v1/completions", json={"model": "toy/model", "prompt": "hello<|im_end|>", "max_tokens": 2}
        )
    assert ok.status_code == 200, ok.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert "past the model's vocabulary of 400" in bad.json()["error"]["message"]


def test_unknown_fields_are_refused_unless_the_server_allows_them() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "min_tokens": 3, "top_k": 2}'
    err = _refused(body)
    assert err.status == 400 and err.param == "min_tokens" and "http.allow_unknown_fields" in err.message
    req, raw = parse_body(body, ChatCompletionRequest, allow_unknown=True)  # the opt-out drops them
    assert req.top_k == 2 and "min_tokens" not in raw
    # a field refused unless null stays known: null is accepted either way
    assert (
        parse_body(
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "audio": null}',
            ChatCompletionRequest,
        )[0].model
        == "m"
    )
