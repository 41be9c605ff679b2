"""``/v1/responses`` on a toy engine: a generation that fails mid-stream ends with ``response.failed``; the
output items and events a chat delta sequence (reasoning, text, a tool call) becomes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from litestar.testing import TestClient

from dgpp.config import EngineConfig
from dgpp.serve.app import build_app
from dgpp.serve.responses_output import OutputItems
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.testing.toy_backend import build_toy_backend

MODEL = "toy/model"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok_dir = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    engine = build_toy_backend(
        MODEL,
        tok_dir,
        EngineConfig(
            max_concurrency=4, kv_capacity=2048, block_size=4, prefix_min_tokens=0, stats_interval_s=0
        ),
    )
    with TestClient(app=build_app(engine), base_url="http://dgpp.local") as client:
        yield client, engine
    engine.shutdown()


def _events(text: str) -> list[dict]:
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if line and not line.startswith(":"))
        if lines:
            event = json.loads(lines["data"])
            assert event["type"] == lines["event"]
            out.append(event)
    return out


def test_a_failing_generation_ends_the_stream_with_response_failed(server) -> None:
    client, engine = server
    real_submit = engine.submit

    class AllowsNothing:  # a mask that allows nothing: the choice's sampling raises
        def mask(self, vocab):
            return torch.zeros(vocab, dtype=torch.bool)

        def accept(self, token):
            pass

    def submit_with_empty_mask(request):
        return real_submit(replace(request, matchers=(AllowsNothing(),) * request.n))

    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4, "reasoning": {"effort": "none"}}
    engine.submit = submit_with_empty_mask
    try:
        with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = _events(r.read().decode())
        one_shot = client.post("/v1/responses", json=body)
    finally:
        engine.submit = real_submit
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed"
    assert one_shot.status_code == 500 and one_shot.json()["error"]["code"] == "generation_failed"
    # the failed response was not stored, and the engine serves on (greedy: the 4-token cap, not a sampled EOS,
    # ends it)
    assert client.get(f"/v1/responses/{failed['id']}").status_code == 404
    assert client.post("/v1/responses", json={**body, "temperature": 0}).json()["status"] == "incomplete"


def test_items_follow_the_order_the_model_wrote_them() -> None:
    items = OutputItems(logprobs=True)
    entry = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    events = items.feed([{"reasoning_content": "think"}], [{**entry, "reasoning": True}])
    events += items.feed([{"content": "Hi"}], [entry])
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    events += items.feed(
        [{"tool_calls": [call]}, {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}], []
    )
    events += items.finish(incomplete=False)
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert items.items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert items.items[1]["content"][0]["logprobs"] == [
        entry
    ]  # the reasoning token's entry is not the text's
    assert items.items[2] | {"id": ""} == {
        "id": "",
        "type": "function_call",
        "status": "completed",
        "call_id": "call_1",
        "name": "f",
        "arguments": "{}",
    }
    added = events[0]["item"]
    assert added["status"] == "in_progress" and added["content"] == []  # a snapshot, not the finished item


def test_an_empty_or_cut_output() -> None:
    empty = OutputItems(logprobs=False)
    empty.finish(incomplete=False)
    assert [(i["type"], i["content"][0]["text"]) for i in empty.items] == [("message", "")]
    cut = OutputItems(logprobs=False)
    cut.feed([{"reasoning_content": "still thinking"}], [])
    cut.finish(incomplete=True)
    assert [(i["type"], i["status"]) for i in cut.items] == [("reasoning", "incomplete")]
