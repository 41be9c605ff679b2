"""End to end: bad ``POST /v1/responses`` requests answered as OpenAI-shaped errors, and a client that hangs up
mid-response freeing its sequence."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from responses_client import NO_THINK, QUESTION, respond

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "The quick brown fox " * 200}, 400, "input"),  # past the 512-token context
        ({"input": "x", "max_output_tokens": 600}, 400, "max_output_tokens"),
        ({"input": "x", "bogus_option": 1}, 400, "bogus_option"),
        ({"input": 5}, 400, "input"),
        ({}, 400, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
                ]
            },
            400,
            "input",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, 400, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, 400, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": "x", "reasoning": {"effort": "huge"}}, 400, "reasoning.effort"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "context_management": [{"type": "compaction"}]}, 400, "context_management"),
        ({"input": "x", "truncation": "auto"}, 400, "truncation"),
        ({"input": "x", "include": ["everything"]}, 400, "include[0]"),
        ({"input": "x", "stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
        ({"input": "x", "previous_response_id": "resp_unknown"}, 400, "previous_response_id"),
        ({"input": "x", "model": "other"}, 404, "model"),
    ],
)
def test_bad_requests_are_openai_shaped_errors(env, body, status, param) -> None:
    r = httpx.post(env["server"].url + "/v1/responses", json={"model": env["model"], **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_bad_request_through_the_sdk_is_a_400(env) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        respond(env, input=[{"type": "item_reference", "id": "msg_1"}])
    assert bad.value.status_code == 400 and bad.value.param == "input"
    assert httpx.get(env["server"].url + "/v1/responses/resp_nope").status_code == 404


def _scheduler(env) -> dict:
    body = httpx.get(env["server"].url + "/metrics", timeout=30).json()
    return {**body["scheduler"], "finished": body["finished"]}


def _wait_for(env, done, what: str) -> dict:
    deadline = time.monotonic() + 120  # the limit only turns a hang into a failure
    while time.monotonic() < deadline:
        state = _scheduler(env)
        if done(state):
            return state
        time.sleep(0.1)
    raise AssertionError(f"{what}: last /metrics scheduler {state}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_frees_its_sequence(env, stream) -> None:
    before = _scheduler(env)
    payload = json.dumps(
        {
            "model": env["model"],
            "input": QUESTION,
            "max_output_tokens": 400,
            "stream": stream,
            "reasoning": NO_THINK,
            "ignore_eos": True,
        }
    ).encode()
    sock = socket.create_connection(("127.0.0.1", env["server"].port), timeout=60)
    sock.sendall(
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    _wait_for(env, lambda s: s["active"] >= 1, "the request never started")
    sock.close()
    after = _wait_for(env, lambda s: s["active"] == 0 and s["queued"] == 0, "the sequence still decodes")
    finished = {k: after["finished"].get(k, 0) - before["finished"].get(k, 0) for k in after["finished"]}
    assert finished.get("cancelled", 0) == 1 and not finished.get("length"), finished
    assert after["tokens_generated"] - before["tokens_generated"] < 400
