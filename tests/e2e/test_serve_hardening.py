"""End to end against ``dgpp serve`` (tiny Qwen3 checkpoint, real child process, real clients): half-sent and
oversized bodies cannot starve the server, client mistakes get OpenAI-shaped 4xx, special tokens stay out of
the text, and the legacy completions route serves token-id prompts, batches, echo and prompt logprobs."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest
import torch
from serve_fixture import Server, tiny_checkpoint

from dgpp.testing.builders import load_reference
from dgpp.text.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
MAX_CONNECTIONS = 4
ENGINE = {
    "max_concurrency": 4,
    "kv_capacity": 4096,
    "block_size": 4,
    "prefill_budget_tokens": 16,
    "prefix_min_tokens": 0,
    "default_max_tokens": 16,
    "queue_limit": 64,
    "stats_interval_s": 0,
    "max_connections": MAX_CONNECTIONS,
}
HTTP = {"max_body_bytes": 64 * 2**20, "body_timeout_s": 2, "sse_ping_interval": 1}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "Hello world! What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    ckpt = tiny_checkpoint("qwen3", root)
    server = Server(ckpt, root, ENGINE, http=HTTP)
    try:
        server.wait_ready()
        yield {
            "server": server,
            "ckpt": ckpt,
            "tok": Tokenizer.from_dir(ckpt),
            "model": str(ckpt),
            "sdk": openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
        }
    finally:
        server.stop()


def raw_request(server: Server, head: bytes, body: bytes = b"") -> socket.socket:
    """A socket that sent ``head`` (request line and headers, without the blank line) and ``body``."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(head + b"\r\n\r\n" + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def openai_error(body: bytes, code: str) -> dict:
    e = json.loads(body)["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == code and e["message"]
    return e


def completion(env, **kw) -> httpx.Response:
    return httpx.post(env["server"].url + "/v1/completions", json={"model": env["model"], **kw}, timeout=60)


def chat(env, **kw) -> httpx.Response:
    body = {"model": env["model"], "messages": USER, **NO_THINK, **kw}
    return httpx.post(env["server"].url + "/v1/chat/completions", json=body, timeout=60)


def test_half_sent_bodies_hold_no_slot_and_time_out(env) -> None:
    server = env["server"]
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000"
    )
    stalled = [raw_request(server, head, b'{"model": ') for _ in range(4 * MAX_CONNECTIONS)]
    try:
        # every connection slot would be held by now if half-sent bodies counted against engine.max_connections
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        r = completion(env, prompt="Hello", max_tokens=2)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # a body shorter than its Content-Length is not waited on forever: 408 after http.body_timeout_s
        status, headers, body = read_response(stalled[0])
        assert status == 408 and headers["x-request-id"].startswith("req-")
        openai_error(body, "request_timeout")
    finally:
        for s in stalled:
            s.close()


def test_oversized_prompt_is_refused_before_tokenizing_and_health_answers(env) -> None:
    health: list[int] = []
    prompt = "hello world " * 1_700_000  # 20 MB; tokenizing it took seconds and gigabytes before
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("r", completion(env, prompt=prompt, max_tokens=1))
    )
    worker.start()
    while worker.is_alive() and len(health) < 3:
        health.append(httpx.get(env["server"].url + "/health", timeout=30).status_code)
    worker.join()
    assert set(health) <= {200}
    r = result["r"]
    assert r.status_code == 400, r.text
    e = openai_error(r.content, "context_length_exceeded")
    assert "at least" in e["message"] and e["param"] == "prompt"


def test_body_limits_and_unreadable_http_in_openai_shape(env) -> None:
    server = env["server"]
    too_big = HTTP["max_body_bytes"] + 1
    sock = raw_request(
        server, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {too_big}".encode()
    )
    status, _, body = read_response(sock)
    assert status == 413
    openai_error(body, "request_too_large")
    sock = raw_request(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc", b"{}")
    status, headers, body = read_response(sock)
    assert status == 400 and headers["content-type"] == "application/json"
    openai_error(body, "invalid_request")


def test_client_mistakes_are_4xx_and_logged_with_the_request_id(env) -> None:
    server = env["server"]
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        headers={"X-Request-Id": "probe-sse-bound"},
        content=json.dumps(
            {"model": env["model"], "prompt": "x", "stream": True, "sse_ping_interval": 10**400}
        ),
    )
    assert r.status_code == 400 and r.headers["x-request-id"] == "probe-sse-bound"
    assert openai_error(r.content, "invalid_parameter")["param"] == "sse_ping_interval"
    log = server.log.read_text()
    assert log.count("probe-sse-bound") == 1 and "request rejected" in log
    for fmt, param in (
        ({}, "response_format.type"),
        ({"Type": "json_object"}, "response_format.type"),
        ({"type": "json_object", "schema": {}}, "response_format.schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}},
            "response_format.json_schema.schema",
        ),
        # a keyword the structured-output backend would skip: refused by name, not loosened
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "contentEncoding": "base64"}},
            },
            "response_format.json_schema.schema",
        ),
    ):
        r = chat(env, max_tokens=2, response_format=fmt)
        assert r.status_code == 400, (fmt, r.text)
        assert json.loads(r.content)["error"]["param"] == param
    assert "'contentEncoding'" in json.loads(r.content)["error"]["message"]


@pytest.mark.parametrize("extra", [{"min_p": 0.1}, {"top_k": 5}, {"top_p": 0.9}])
def test_tiny_temperatures_are_greedy_not_500(env, extra) -> None:
    greedy = completion(env, prompt="The quick brown fox", max_tokens=8, temperature=0, ignore_eos=True)
    tiny = completion(
        env, prompt="The quick brown fox", max_tokens=8, temperature=1e-40, seed=1, ignore_eos=True, **extra
    )
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_overload_answers_503_with_retry_after(env) -> None:
    url = env["server"].url + "/v1/completions"
    # each holds its connection for thousands of steps (16 choices of 400 tokens, 4 sequences at a time);
    # with a 1 s sse_ping_interval even a queued one sends a keep-alive line
    body = {
        "model": env["model"],
        "prompt": "Hello",
        "max_tokens": 400,
        "n": 16,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as client:
        streams = [client.stream("POST", url, json=body) for _ in range(MAX_CONNECTIONS)]
        opened = [s.__enter__() for s in streams]
        try:
            lines = [r.iter_lines() for r in opened]  # kept: a dropped iterator closes its stream
            for it in lines:  # each stream is in flight once its first line arrived
                next(it)
            refused = httpx.post(url, json={**body, "stream": False, "max_tokens": 1}, timeout=60)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            openai_error(refused.content, "overloaded")
        finally:
            for s in streams:
                s.__exit__(None, None, None)


def test_special_tokens_stay_out_of_the_text_by_default(env) -> None:
    im_start = env["tok"].token_to_id("<|im_start|>")
    forced = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logit_bias": {str(im_start): 100}}
    plain = completion(env, **forced).json()["choices"][0]
    assert plain["text"] == "" and plain["finish_reason"] == "length"
    kept = completion(env, **forced, skip_special_tokens=False).json()["choices"][0]["text"]
    assert kept == "<|im_start|> <|im_start|> <|im_start|>"
    packed = completion(env, **forced, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert packed.json()["choices"][0]["text"] == "<|im_start|>" * 3
    think = env["tok"].token_to_id("<think>")  # not special: a marker the reasoning split reads stays text
    marker = completion(env, prompt="Hello", max_tokens=2, temperature=0, logit_bias={str(think): 100})
    assert marker.json()["choices"][0]["text"] == "<think><think>"


def test_reasoning_effort_with_an_explicit_switch(env) -> None:
    r = chat(env, max_tokens=4, temperature=0, reasoning_effort="low")
    assert r.status_code == 200, r.text
    assert not r.json()["choices"][0]["message"].get("reasoning_content")


def test_reasoning_tokens_have_logprobs(env) -> None:
    body = {
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    choice = chat(env, **body).json()["choices"][0]
    reasoning = choice["message"]["reasoning_content"]
    entries = choice["logprobs"]["reasoning_content"]
    assert len(entries) + len(choice["logprobs"]["content"]) == 6
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace").startswith(reasoning[:1])
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in entries)
    chunks = httpx.post(
        env["server"].url + "/v1/chat/completions",
        timeout=60,
        json={"model": env["model"], "messages": USER, **body, "stream": True},
    ).text
    streamed = [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: {")]
    got = [
        e
        for c in streamed
        for ch in c["choices"]
        if ch["logprobs"]
        for e in ch["logprobs"].get("reasoning_content", [])
    ]
    assert [e["logprob"] for e in got] == [e["logprob"] for e in entries]


def test_legacy_token_ids_batches_and_n(env) -> None:
    sdk, tok = env["sdk"], env["tok"]
    text = sdk.completions.create(
        model=env["model"], prompt="The quick brown fox", max_tokens=6, temperature=0, user="u-1"
    )
    ids = tok.encode("The quick brown fox")
    by_ids = sdk.completions.create(model=env["model"], prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    batch = sdk.completions.create(
        model=env["model"],
        prompt=[ids, tok.encode("def add(a, b):")],
        max_tokens=6,
        temperature=0,
        n=2,
        best_of=2,
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + len(tok.encode("def add(a, b):"))
    seeded = [
        sdk.completions.create(model=env["model"], prompt=ids, max_tokens=6, temperature=1.0, seed=3, n=3)
        for _ in range(2)
    ]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]


def test_echo_with_prompt_logprobs_matches_transformers(env) -> None:
    sdk, tok = env["sdk"], env["tok"]
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(prompt)
    r = sdk.completions.create(model=env["model"], prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        logits = load_reference(env["ckpt"])(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        # legacy top_logprobs is keyed by text (byte pieces and padded ids may collide): each value is one of
        # the row's two best
        best = torch.topk(want[i - 1], 2).values.tolist()
        assert all(any(abs(v - b) < 1e-4 for b in best) for v in lp.top_logprobs[i].values())
    # echo with generation: the prompt's entries, then the generated ones, offsets running on
    more = sdk.completions.create(
        model=env["model"], prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    c = more.choices[0]
    assert c.text.startswith(prompt) and len(c.logprobs.tokens) == len(ids) + 3
    assert c.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert c.logprobs.text_offset[len(ids)] == len(prompt)
    streamed = sdk.completions.create(
        model=env["model"], prompt=prompt, max_tokens=3, echo=True, stream=True, temperature=0
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text


def test_prefix_hit_at_a_block_between_cuts_returns_cold_tokens(env) -> None:
    """On the CPU a prompt row is the same however the prompt is chunked, so the prefix cache attaches at any
    full KV block (4 tokens here), not only at the 16-token chunk cuts: a prompt sharing 26 tokens with an
    earlier one reuses 24 of them (16 at cut granularity), and its greedy tokens equal a cold run's."""
    from dgpp.offline import greedy_generate
    from dgpp.startup.loading import load_model

    ids = env["tok"].encode(
        "Prefix blocks: one two three four five six seven eight nine ten eleven twelve. " * 3
    )
    shared = ids[:26]
    first, second = shared + ids[30:33], shared + ids[40:42]
    want = env["tok"].decode(greedy_generate(load_model(env["ckpt"]), [second], 8, stop_at_eos=False)[0])

    def run(prompt: list[int], **extra) -> openai.types.Completion:
        return env["sdk"].completions.create(
            model=env["model"],
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "skip_special_tokens": False, **extra},
        )

    cold = run(second, prefix_cache=False)
    run(first)
    hit = run(second)
    assert hit.usage.prompt_tokens_details.cached_tokens == 24
    assert hit.choices[0].text == cold.choices[0].text == want


def test_best_of_returns_the_most_likely_candidates(env) -> None:
    """best_of > n generates best_of candidates (those n=best_of would give: choice i draws from (seed, i)) and
    answers with the n of the highest cumulative logprob, best first; usage counts every candidate."""
    sdk, model = env["sdk"], env["model"]
    sampled = {
        "prompt": "The quick brown fox",
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
        "extra_body": {"ignore_eos": True},
    }
    candidates = sdk.completions.create(model=model, n=4, logprobs=0, **sampled).choices
    score = {c.text: sum(c.logprobs.token_logprobs) for c in candidates}
    ranked = sorted(candidates, key=lambda c: (-score[c.text], c.index))
    assert [c.index for c in ranked[:2]] != [0, 1]  # returning the first n candidates would fail
    best = sdk.completions.create(model=model, n=2, best_of=4, **sampled)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and [
        c.index for c in best.choices
    ] == [0, 1]
    assert best.usage.completion_tokens == 4 * 6
    assert best.choices[0].logprobs is None  # ranked by logprobs, not reporting them unless asked
    for extra, why in (
        ({"n": 3, "best_of": 2}, "greater than or equal"),
        ({"best_of": 2, "stream": True}, "streamed"),
    ):
        r = completion(env, prompt="Hi", max_tokens=2, **extra)
        assert r.status_code == 400 and why in openai_error(r.content, "invalid_parameter")["message"]
        assert json.loads(r.content)["error"]["param"] == "best_of"
