"""End to end (real ``dgpp serve`` child, tiny Qwen3): a client that hangs up on a legacy completion with several
prompts, ``n`` > 1 or a prompt being scored leaves no sequence of it decoding, and the server keeps answering."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from serve_fixture import Server, tiny_checkpoint

pytestmark = pytest.mark.e2e
ENGINE = {
    "max_concurrency": 8,
    "kv_capacity": 8192,
    "block_size": 4,
    "prefill_budget_tokens": 16,
    "prefix_min_tokens": 0,
    "queue_limit": 64,
    "stats_interval_s": 0,
}
MAX_TOKENS = 480


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("disconnect")
    server = Server(tiny_checkpoint("qwen3", root), root, ENGINE)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def scheduler(server: Server) -> dict:
    """``/metrics`` ``scheduler``, with the retirements by reason (``finished``) beside its counters."""
    body = httpx.get(server.url + "/metrics", timeout=30).json()
    return {**body["scheduler"], "finished": body["finished"]}


def wait_for(server: Server, done, what: str, limit_s: float = 120.0) -> dict:
    """Poll ``/metrics`` until ``done(scheduler)``; the limit only turns a hang into a failure."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        state = scheduler(server)
        if done(state):
            return state
        time.sleep(0.1)
    raise AssertionError(
        f"{what}: not reached; last /metrics scheduler: {state}\n{server.log.read_text()[-3000:]}"
    )


def send_and_hang_up(server: Server, body: dict, started) -> None:
    """Send ``body`` to /v1/completions on a raw socket, wait until the engine works on it, then close."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    wait_for(server, started, "the request never started")
    sock.close()


@pytest.mark.parametrize("shape", ["prompts_and_n", "echo_scoring"])
def test_a_client_that_hangs_up_leaves_no_sequence_decoding(server, shape) -> None:
    model = json.loads(server.config.read_text())["model"]
    before = scheduler(server)
    if shape == "prompts_and_n":  # 2 prompts x n 2 = 4 sequences of 480 tokens each (the context is 512)
        body = {
            "model": model,
            "prompt": ["Hello there", "The quick brown fox"],
            "n": 2,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
        }
        expected_cancels = 4
    else:  # 2 prompts of ~340 tokens scored one token per step (echo + logprobs) before any generation starts
        long = "one two three four five six seven eight nine ten " * 8
        body = {
            "model": model,
            "prompt": [long, long + "eleven"],
            "echo": True,
            "logprobs": 1,
            "max_tokens": 100,
            "ignore_eos": True,
        }
        expected_cancels = 2
    send_and_hang_up(server, body, lambda s: s["active"] >= expected_cancels)
    after = wait_for(server, lambda s: s["active"] == 0 and s["queued"] == 0, "sequences still live")
    finished = {k: after["finished"].get(k, 0) - before["finished"].get(k, 0) for k in after["finished"]}
    assert finished.get("cancelled", 0) == expected_cancels, finished
    assert not any(finished.get(k) for k in ("length", "eos", "stop")), finished  # nothing ran to its end
    assert after["tokens_generated"] - before["tokens_generated"] < expected_cancels * MAX_TOKENS
    # the server still answers a small request
    r = httpx.post(
        server.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
