"""API shapes on a toy engine (no checkpoint): routes, SSE, errors, stop strings, n/seed, logit_bias, metrics."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import replace

import openai
import pytest
import torch
from litestar.testing import TestClient

from dgpp.config import EngineConfig
from dgpp.sample import SamplingParams
from dgpp.sched.thread_handoff import GenerationRequest
from dgpp.serve.app import build_app
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.testing.toy_backend import build_toy_backend

MODEL = "toy/model"
USER = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok_dir = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    cfg = EngineConfig(
        max_concurrency=4,
        kv_capacity=4096,
        block_size=4,
        prefill_budget_tokens=8,
        prefix_min_tokens=0,
        queue_limit=16,
        stats_interval_s=0,
    )
    # the toy model never favours EOS, so outputs run to max_tokens unless a test says otherwise
    engine = build_toy_backend(MODEL, tok_dir, cfg)
    app = build_app(engine, max_body_bytes=20000, sse_ping_interval=30)
    with TestClient(app=app, base_url="http://dgpp.local") as client:
        yield client, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sdk(server):
    client, _ = server
    return openai.OpenAI(base_url="http://dgpp.local/v1", api_key="x", http_client=client)


def chat(sdk, **kw):
    """Thinking off unless a test turns it on: the tiny template otherwise opens a <think> block."""
    extra = {
        "chat_template_kwargs": {"enable_thinking": kw.pop("thinking", False)},
        **kw.pop("extra_body", {}),
    }
    return sdk.chat.completions.create(model=MODEL, messages=kw.pop("messages", USER), extra_body=extra, **kw)


def test_models_health_and_unknown_routes(server) -> None:
    client, _ = server
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["owned_by"] == "dgpp"
    assert client.get(f"/v1/models/{MODEL}").json()["context"]["kv_pool_tokens"] == 4096
    assert client.get("/health").json() == {"status": "ok", "model": MODEL}
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == "unknown route: GET /nope"
    r = client.post("/metrics")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_chat_one_shot_and_stream_agree(sdk) -> None:
    one = chat(sdk, max_tokens=12, temperature=0)
    assert one.object == "chat.completion" and one.id.startswith("chatcmpl-")
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 12
    assert one.usage.total_tokens == one.usage.prompt_tokens + 12
    chunks = list(
        chat(sdk, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == one.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # llama.cpp-style timings (a DGPP extension) on the last choice chunk and in one-shot bodies
    assert chunks[-2].model_extra["timings"]["predicted_n"] == 11
    t = one.model_extra["timings"]
    assert (
        t["prompt_n"] + t["cache_n"] == one.usage.prompt_tokens
        and t["predicted_n"] == 11
        and t["predicted_ms"] >= 0
    )


def test_raw_sse_framing(server) -> None:
    client, _ = server
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 3, "stream": True, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: ") :])
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")
    assert "obfuscation" not in first  # legacy streams are never padded
    chat_body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 3,
        "stream": True,
        "service_tier": "auto",
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=chat_body) as r:
        payloads = [e[len("data: ") :] for e in r.read().decode().replace("\r\n", "\n").split("\n\n") if e][
            :-1
        ]
    for p in payloads:  # chat events are padded to 128-byte buckets with at least 16 random characters
        body = json.loads(p)
        assert (
            len(p.encode()) % 128 == 0
            and len(body["obfuscation"]) >= 16
            and body["service_tier"] == "default"
        )
    chat_body["stream_options"]["include_obfuscation"] = False
    with client.stream("POST", "/v1/chat/completions", json=chat_body) as r:
        assert "obfuscation" not in r.read().decode()


def test_legacy_completion_and_logprobs(sdk) -> None:
    r = sdk.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    # legacy top_logprobs is keyed by token text: byte pieces of one character may collide
    assert len(lp.tokens) == 5 and 1 <= len(lp.top_logprobs[0]) <= 2 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and all(x <= 0 for x in lp.token_logprobs)
    c = chat(sdk, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and len(content[0].top_logprobs) == 3
    assert content[0].logprob == content[0].top_logprobs[0].logprob  # greedy picks the top entry


def test_reasoning_goes_to_reasoning_content(sdk) -> None:
    r = chat(sdk, max_tokens=6, temperature=0, thinking=True)
    msg = r.choices[0].message
    assert msg.content == "" and len(msg.reasoning_content) > 0  # the toy model never writes </think>
    assert r.usage.completion_tokens_details.reasoning_tokens == 6
    chunks = list(chat(sdk, max_tokens=6, temperature=0, thinking=True, stream=True))
    streamed = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert streamed == msg.reasoning_content


def test_stop_strings_cut_exactly_also_in_streams(sdk) -> None:
    full = chat(sdk, max_tokens=24, temperature=0).choices[0].message.content
    assert len(full) > 12
    stop = full[5:9]  # likely spans a token boundary
    cut = full[: full.index(stop)]
    one = chat(sdk, max_tokens=24, temperature=0, stop=[stop, "never-appears"])
    assert one.choices[0].message.content == cut and one.choices[0].finish_reason == "stop"
    assert one.usage.completion_tokens < 24
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in chat(sdk, max_tokens=24, temperature=0, stop=stop, stream=True)
        if c.choices
    )
    assert streamed == cut


def test_seeded_n_choices_reproduce(sdk) -> None:
    a = chat(sdk, max_tokens=8, temperature=1.0, seed=1234, n=3)
    b = chat(sdk, max_tokens=8, temperature=1.0, seed=1234, n=3)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices] and len(set(texts)) > 1
    assert [c.index for c in a.choices] == [0, 1, 2]


def test_logit_bias_forces_and_forbids(sdk, server) -> None:
    _, engine = server
    tid = engine.tokenizer.encode(" fox")[0]
    forced = chat(sdk, max_tokens=4, temperature=0.8, seed=3, logit_bias={str(tid): 100})
    assert forced.choices[0].message.content == engine.tokenizer.decode([tid] * 4)
    free = chat(sdk, max_tokens=6, temperature=0, logprobs=True)
    # an entry's ``token`` is the text it added (maybe "" for part of a character); ``bytes`` names the token
    token_of = {b: i for i, b in enumerate(engine.tokenizer.token_bytes)}
    banned = token_of[bytes(free.choices[0].logprobs.content[0].bytes)]
    again = chat(sdk, max_tokens=6, temperature=0, logprobs=True, logit_bias={str(banned): -100})
    assert banned not in [token_of[bytes(t.bytes)] for t in again.choices[0].logprobs.content]


def test_prefix_cache_hit_matches_cold(sdk) -> None:
    long = [{"role": "system", "content": "You are a helpful assistant. Think step by step. " * 3}, *USER]
    cold = chat(sdk, messages=long, max_tokens=8, temperature=0, extra_body={"prefix_cache": False})
    first = chat(sdk, messages=long, max_tokens=8, temperature=0)
    hit = chat(sdk, messages=long, max_tokens=8, temperature=0)
    assert (
        first.choices[0].message.content == cold.choices[0].message.content == hit.choices[0].message.content
    )
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


def err(r, status: int, code: str | None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == code and e["message"]
    assert e["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert e["param"] == param
    return e


def test_error_classes(server) -> None:
    client, engine = server
    post = lambda body, path="/v1/chat/completions": client.post(path, json=body)  # noqa: E731
    base = {"model": MODEL, "messages": USER}
    err(post({**base, "temperature": 3}), 400, "invalid_parameter", "temperature")
    err(post({**base, "model": "gpt-4"}), 404, "model_not_found", "model")
    err(post({**base, "functions": []}), 400, "unsupported_parameter", "functions")
    err(post({**base, "max_tokens": 5, "max_completion_tokens": 5}), 400, "invalid_parameter", "max_tokens")
    err(post({**base, "logit_bias": {"99999": 1}}), 400, "invalid_parameter", "logit_bias")
    err(post({**base, "max_tokens": 5000}), 400, "context_length_exceeded", "max_tokens")
    err(post({"model": MODEL, "prompt": ["a", 1]}, "/v1/completions"), 400, "invalid_parameter", "prompt")
    err(post({"model": MODEL, "prompt": [[1, -1]]}, "/v1/completions"), 400, "invalid_parameter", "prompt")
    err(
        post({"model": MODEL, "prompt": "a", "suffix": "b"}, "/v1/completions"),
        400,
        "unsupported_parameter",
        "suffix",
    )
    err(
        post({"model": MODEL, "prompt": "a", "n": 3, "best_of": 2}, "/v1/completions"),
        400,
        "invalid_parameter",
        "best_of",
    )
    err(
        client.post("/v1/chat/completions", content=b'{"model": "a", "model": "b"}'),
        400,
        "invalid_parameter",
        "model",
    )
    err(client.post("/v1/chat/completions", content=b"x" * 30000), 413, "request_too_large")
    bad_tool = {"type": "function", "function": {"name": "get weather"}}
    err(post({**base, "tools": [bad_tool]}), 400, "invalid_parameter", "tools[0]")
    err(post({**base, "tool_choice": "required"}), 400, "invalid_parameter", "tool_choice")
    image = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
    ]
    refused = post({**base, "messages": [{"role": "user", "content": image}]})
    err(refused, 400, "unsupported_parameter", "messages[0].content[1]")
    assert repr(base["model"]) in refused.json()["error"]["message"]  # the refusal names the model
    err(post({**base, "messages": [{"role": "bogus", "content": "x"}]}), 400, "invalid_parameter", "messages")
    surrogate = b'{"model": "toy/model", "messages": [{"role": "user", "content": "\\ud800"}]}'
    err(client.post("/v1/chat/completions", content=surrogate), 400, "invalid_parameter")
    err(
        post({**base, "stream": True, "stream_options": {"include_usage": True, "x": 1}}),
        400,
        "unsupported_parameter",
        "stream_options.x",
    )
    grammar, engine.grammar = engine.grammar, None  # as on a build without llguidance
    try:
        err(
            post({**base, "response_format": {"type": "json_object"}}),
            400,
            "constrained_decoding_unsupported",
            "response_format",
        )
    finally:
        engine.grammar = grammar
    assert post({**base, "max_tokens": 2, "preserveThinking": True, "user": "u"}).status_code == 200


def test_metrics_json_and_prometheus(server, sdk) -> None:
    client, _ = server
    chat(sdk, max_tokens=2, temperature=0)
    m = client.get("/metrics").json()
    assert set(client.get("/v1/metrics").json()) == set(m)
    for key in (
        "active",
        "queued",
        "pool_blocks_total",
        "pool_blocks_in_use",
        "tokens_generated",
        "decode_batch",
        "spec_decode",
        "snapshot_age_ms",
    ):
        assert key in m["scheduler"]
    assert len(m["scheduler"]["decode_batch"]["replays_by_slots"]) == 16
    for key in ("requests_total", "requests_shed", "requests_cancelled", "admission", "rejects_bad"):
        assert key in m["service"]
    assert m["service"]["requests_total"] > 0 and m["prefix_cache"]["enabled"] is True
    assert m["prefix_cache"]["ttft_miss_count"] > 0 and m["prefix_cache"]["ttft_miss_ms_avg"] > 0
    text = client.get("/metrics/prometheus").text
    assert 'dgpp_requests_total{model_name="toy/model"}' in text
    assert 'dgpp_request_finished_total{model_name="toy/model",reason="length"}' in text
    assert 'dgpp_time_to_first_token_seconds_count{model_name="toy/model",prefix_cache="miss"}' in text
    assert 'dgpp_e2e_request_latency_seconds_bucket{le="0.005",model_name="toy/model"}' in text


def test_engine_failure_answers_503_and_health_says_why(tmp_path) -> None:
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    engine = build_toy_backend(
        MODEL, tok_dir, EngineConfig(kv_capacity=512, block_size=4, stats_interval_s=0)
    )
    runner = engine.loop.scheduler.runner
    working, calls = runner.step, []

    def fails_on_the_fourth_step(works):
        calls.append(1)
        if len(calls) >= 4:
            raise RuntimeError("device lost")
        return working(works)

    runner.step = fails_on_the_fourth_step
    with TestClient(app=build_app(engine), base_url="http://dgpp.local") as client:
        # ignore_eos: a sampled EOS before the fourth step would end the stream normally, before the failure
        body = {
            "model": MODEL,
            "messages": USER,
            "max_tokens": 10,
            "stream": True,
            "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False},
            "stream_options": {"include_obfuscation": False},
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200  # headers went out before the failure
            events = [e for e in r.read().decode().replace("\r\n", "\n").split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        failure = json.loads(events[-2][len("data: ") :])["error"]
        assert failure["type"] == "server_error" and failure["code"] == "engine_failure"
        assert '"content"' in "".join(events[:-2])  # the tokens made before the failure were flushed first
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2})
        err(r, 503, "engine_failure")
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "device lost" in health.json()["error"]
        err(client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 503, "engine_failure")
        assert client.get("/metrics").json()["service"]["engine_failed"] is True
    engine.shutdown()


def test_keep_alive_comment_after_silence(server) -> None:
    """The SSE writer alone: an event arrives after 1.3 s of silence with a 1 s ping interval."""
    import asyncio

    from dgpp.sample import SamplingParams
    from dgpp.sched.request import RetireReason, SeqEvent
    from dgpp.sched.thread_handoff import GenerationRequest
    from dgpp.serve.backend import RequestHandle
    from dgpp.serve.completions import _stream
    from dgpp.serve.openai_format import ChunkWriter

    _, engine = server

    async def run() -> list[bytes]:
        request = GenerationRequest("chatcmpl-x", (1, 2), SamplingParams(max_tokens=1))
        handle = RequestHandle(request, engine.inbox)
        outputs = engine.output_processors(handle, None)
        writer = ChunkWriter(handle.request_id, 0, MODEL, chat=True, include_usage=False)
        asyncio.get_running_loop().call_later(
            1.3, handle.queue.put_nowait, (0, SeqEvent([], [], retired=RetireReason.LENGTH))
        )
        return [chunk async for chunk in _stream(engine, handle, outputs, writer, 1)]

    chunks = asyncio.run(run())
    assert chunks[0] == b": keep-alive\n\n" and chunks[-1] == b"data: [DONE]\n\n"
    events = b"".join(chunks[1:-1]).split(b"\n\n")[:-1]
    assert (
        b'"role":"assistant"' in events[0] and b'"finish_reason":"length"' in events[1]
    )  # lazy preamble first


def test_connection_limit_answers_openai_shaped_503() -> None:
    import asyncio

    from dgpp.serve.http_guard import ConnectionLimit

    release = asyncio.Event()

    async def slow_app(scope, receive, send) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    shed: list[int] = []
    limited = ConnectionLimit(slow_app, 1, on_reject=lambda: shed.append(1))

    async def call() -> list[dict]:
        sent: list[dict] = []

        async def send(msg: dict) -> None:
            sent.append(msg)

        await limited({"type": "http"}, None, send)
        return sent

    async def run() -> tuple[list[dict], list[dict]]:
        first = asyncio.create_task(call())
        await asyncio.sleep(0)
        refused = await call()
        release.set()
        return await first, refused

    ok, refused = asyncio.run(run())
    assert ok[0]["status"] == 200 and refused[0]["status"] == 503 and shed == [1]
    assert json.loads(refused[1]["body"])["error"]["code"] == "overloaded"


def test_default_max_tokens_is_cut_to_the_room_the_prompt_leaves(sdk, server) -> None:
    client, engine = server
    long = sdk.completions.create(
        model=MODEL,
        prompt="Hello world! " * 1300,
        temperature=0,  # ~3900 tokens
        extra_body={"ignore_eos": True},
    )
    room = engine.limits.request_limit_tokens - long.usage.prompt_tokens
    assert (
        0 < room < 256 and long.usage.completion_tokens == room and long.choices[0].finish_reason == "length"
    )
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world! " * 1400})
    err(r, 400, "context_length_exceeded", "prompt")


@contextmanager
def sampling_fails(engine):
    """Requests started inside get a grammar mask that allows nothing: their sampling raises."""
    real_submit = engine.submit

    class AllowsNothing:
        def mask(self, vocab):
            return torch.zeros(vocab, dtype=torch.bool)

        def accept(self, token):
            pass

    def submit_with_empty_mask(request):
        return real_submit(replace(request, matchers=(AllowsNothing(),) * request.n))

    engine.submit = submit_with_empty_mask
    try:
        yield
    finally:
        engine.submit = real_submit


def test_a_failing_sampler_fails_only_its_request(server, sdk) -> None:
    """A request whose sampling raises (here: a mask that allows nothing) gets a 500; the engine serves on."""
    client, engine = server
    with sampling_fails(engine):
        r = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": USER, "max_tokens": 3, "temperature": 1.0},
        )
    e = err(r, 500, "generation_failed")
    assert "masked" in e["message"]
    assert client.get("/health").status_code == 200
    assert chat(sdk, max_tokens=2, temperature=0).choices[0].finish_reason == "length"


def test_overloaded_queue_sheds_with_503(server) -> None:
    """Runs last in this module: it parks the step loop thread so nothing drains, then fills the queue."""
    client, engine = server
    engine.loop.stop()
    parked = GenerationRequest("parked", (1,), SamplingParams(max_tokens=1))
    for _ in range(engine.queue_limit):  # queue_limit requests, parked in the inbox
        engine.inbox.requests.append((parked, lambda s, ev: None, 0.0))
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2})
    err(r, 503, "overloaded")
    assert client.get("/metrics").json()["service"]["requests_shed"] == 1
