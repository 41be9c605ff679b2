"""End to end: ``POST /v1/responses`` on ``dgpp serve`` of a tiny Qwen3 checkpoint (its template has a tool
dialect and a thinking switch), driven by the openai SDK's ``client.responses``; and LiteLLM-shaped thinking
history on ``/v1/chat/completions``."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from serve_fixture import Server, tiny_checkpoint

from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
ENGINE = {
    "max_concurrency": 4,
    "kv_capacity": 4096,
    "block_size": 4,
    "prefill_budget_tokens": 64,
    "prefix_min_tokens": 0,
    "default_max_tokens": 16,
    "queue_limit": 16,
    "stats_interval_s": 0,
}
NO_THINK = {"effort": "none"}  # the tiny template's enable_thinking switch, through the effort mapping
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "weather for a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
STORE_BYTES = 16000  # a few small stored responses: the budget's eviction is reachable in a test
QUESTION = "Hello world! What is the weather in Paris today?"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    ckpt = tiny_checkpoint("qwen3", root)
    server = Server(ckpt, root, ENGINE, http={"responses_store_bytes": STORE_BYTES})
    try:
        server.wait_ready()
        tok = Tokenizer.from_dir(ckpt)
        yield {
            "server": server,
            "tok": tok,
            "template": ChatTemplate.for_checkpoint(tok),
            "model": str(ckpt),
            "sdk": openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
        }
    finally:
        server.stop()


def respond(env, **kw):
    return env["sdk"].responses.create(model=env["model"], **kw)


def prompt_tokens(env, messages, tools=None, **kwargs) -> int:
    return len(env["tok"].encode(env["template"].render(messages, tools, chat_template_kwargs=kwargs)))


def test_text_one_shot_stream_and_chat_agree(env) -> None:
    """Greedy output of a Responses request equals the chat route's on the same conversation, streamed or not,
    and the stream's events come in the Responses order."""
    chat = env["sdk"].chat.completions.create(
        model=env["model"],
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    one = respond(
        env,
        instructions="Be brief.",
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
        reasoning=NO_THINK,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert one.object == "response" and one.id.startswith("resp_")
    assert one.output_text == chat.choices[0].message.content and one.output_text
    assert one.status == "incomplete" and one.incomplete_details.reason == "max_output_tokens"
    assert one.usage.input_tokens == chat.usage.prompt_tokens and one.usage.output_tokens == 12
    assert one.usage.total_tokens == one.usage.input_tokens + 12
    part = one.output[0].content[0]
    assert one.output[0].type == "message" and one.output[0].role == "assistant"
    want = [(e.bytes, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    assert [(e.bytes, e.logprob, [t.token for t in e.top_logprobs]) for e in part.logprobs] == want
    assert len(want) == 12 and len(part.logprobs[0].top_logprobs) == 2
    events = list(
        respond(
            env,
            instructions="Be brief.",
            input=QUESTION,
            max_output_tokens=12,
            temperature=0,
            reasoning=NO_THINK,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == one.output_text == events[-2].item.content[0].text
    assert events[0].response.status == "in_progress" and events[-1].response.output_text == one.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_reasoning_item_streamed_and_not(env) -> None:
    """With thinking on, the reasoning goes to a reasoning item (reasoning_text), as chat's reasoning_content."""
    chat = env["sdk"].chat.completions.create(
        model=env["model"],
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}},
    )
    one = respond(
        env,
        input=QUESTION,
        max_output_tokens=8,
        temperature=0,
        reasoning={"effort": "high"},
        extra_body={"ignore_eos": True},
    )
    assert [o.type for o in one.output] == ["reasoning"]  # the tiny model does not close </think> this early
    assert one.output[0].content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    assert one.usage.output_tokens_details.reasoning_tokens == 8
    events = list(
        respond(
            env,
            input=QUESTION,
            max_output_tokens=8,
            temperature=0,
            reasoning={"effort": "high"},
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert "".join(deltas) == done.text == one.output[0].content[0].text
    assert events[-1].response.output[0].type == "reasoning"


def test_tool_call_round_trip(env) -> None:
    """A forced call comes back as a function_call item (streamed: arguments delta and done); its output goes
    back as a function_call_output item, through previous_response_id or by resending the items, with the
    same prompt as the chat route renders for that conversation."""
    first = respond(
        env,
        input=QUESTION,
        tools=[TOOL],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
        reasoning=NO_THINK,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) >= 1
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id.startswith("call_") and call.status == "completed" and call.id.startswith("fc_")
    events = list(
        respond(
            env,
            input=QUESTION,
            tools=[TOOL],
            tool_choice="required",
            temperature=0,
            max_output_tokens=60,
            reasoning=NO_THINK,
            stream=True,
        )
    )
    args = [e for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(a.delta for a in args) == done.arguments == call.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    chained = respond(
        env,
        previous_response_id=first.id,
        input=[result],
        tools=[TOOL],
        temperature=0,
        max_output_tokens=6,
        reasoning=NO_THINK,
        extra_body={"ignore_eos": True},
    )
    items = [
        {"role": "user", "content": QUESTION},
        *[o.model_dump(exclude_none=True) for o in first.output],
        result,
    ]
    resent = respond(
        env,
        input=items,
        tools=[TOOL],
        temperature=0,
        max_output_tokens=6,
        reasoning=NO_THINK,
        store=False,
        extra_body={"ignore_eos": True},
    )
    history = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'},
    ]
    want = prompt_tokens(env, history, [CHAT_TOOL], enable_thinking=False)
    assert chained.usage.input_tokens == resent.usage.input_tokens == want
    assert chained.output_text == resent.output_text
    assert chained.previous_response_id == first.id


def test_custom_tool_call_round_trip(env) -> None:
    """A custom (free-form) tool with a regex grammar, forced by name: a custom_tool_call item whose input
    matches the grammar (streamed: input delta and done); its output goes back as custom_tool_call_output."""
    import re

    tool = {
        "type": "custom",
        "name": "set_city",
        "description": "set the city",
        "format": {"type": "grammar", "syntax": "regex", "definition": "(Paris|Rome)"},
    }
    first = respond(
        env,
        input=QUESTION,
        tools=[tool],
        tool_choice={"type": "custom", "name": "set_city"},
        temperature=0,
        max_output_tokens=40,
        reasoning=NO_THINK,
    )
    call = next(o for o in first.output if o.type == "custom_tool_call")
    assert (
        call.name == "set_city"
        and re.fullmatch("Paris|Rome", call.input)
        and call.call_id.startswith("call_")
    )
    events = list(
        respond(
            env,
            input=QUESTION,
            tools=[tool],
            tool_choice={"type": "custom", "name": "set_city"},
            temperature=0,
            max_output_tokens=40,
            reasoning=NO_THINK,
            stream=True,
        )
    )
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == done.input
    assert done.input == call.input
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "done"}
    chained = respond(
        env,
        previous_response_id=first.id,
        input=[result],
        tools=[tool],
        max_output_tokens=2,
        reasoning=NO_THINK,
    )
    history = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "custom", "custom": {"name": "set_city", "input": call.input}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "done"},
    ]
    chat_tool = {
        "type": "custom",
        "custom": {
            "name": "set_city",
            "description": "set the city",
            "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": "(Paris|Rome)"}},
        },
    }
    assert chained.usage.input_tokens == prompt_tokens(env, history, [chat_tool], enable_thinking=False)
    allowed = respond(
        env,
        input=QUESTION,
        tools=[TOOL, tool],
        temperature=0,
        max_output_tokens=60,
        reasoning=NO_THINK,
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "get_weather"}],
        },
    )
    assert [o.name for o in allowed.output if o.type in ("function_call", "custom_tool_call")][
        0
    ] == "get_weather"


def test_a_codex_shaped_request_streams(env) -> None:
    """The fields a Codex-style agent sends with every turn are accepted as they come."""
    shell = {
        "type": "function",
        "name": "shell",
        "description": "run a command",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
            "additionalProperties": False,
        },
    }
    events = list(
        respond(
            env,
            instructions="You are a coding agent.",
            tools=[shell],
            tool_choice="auto",
            parallel_tool_calls=False,
            input=[
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
            ],
            reasoning={"effort": "medium", "summary": "auto"},
            store=False,
            stream=True,
            max_output_tokens=8,
            include=["reasoning.encrypted_content"],
            prompt_cache_key="session-1",
            text={"verbosity": "low"},
        )
    )
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert events[-1].response.store is False and events[-1].response.usage.output_tokens <= 8


def _essence(item) -> tuple:
    """What an output item says (ids and call ids are fresh per response)."""
    texts = tuple(p.text for p in getattr(item, "content", None) or [])
    return (
        item.type,
        getattr(item, "name", None),
        getattr(item, "arguments", None),
        getattr(item, "input", None),
        texts,
    )


@pytest.mark.parametrize("kind", ["json_schema_text", "function_call", "custom_tool_call"])
def test_the_sdk_stream_helper_accumulates_the_same_response(env, kind) -> None:
    """``client.responses.stream`` rebuilds the response from the events alone (item by item, part by part,
    delta by delta) and needs ``response.completed``: outputs that end by EOS (a grammar's end, a forced
    call) equal the one-shot response's."""
    custom = {
        "type": "custom",
        "name": "set_city",
        "format": {"type": "grammar", "syntax": "regex", "definition": "(Paris|Rome)"},
    }
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    kw = {
        "json_schema_text": {"text": {"format": {"type": "json_schema", "name": "u", "schema": schema}}},
        "function_call": {"tools": [TOOL], "tool_choice": "required"},
        "custom_tool_call": {"tools": [custom], "tool_choice": {"type": "custom", "name": "set_city"}},
    }[kind]
    kw = {"reasoning": NO_THINK, "input": QUESTION, "temperature": 0, "max_output_tokens": 60, **kw}
    one = respond(env, **kw)
    with env["sdk"].responses.stream(model=env["model"], **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert one.status == final.status == "completed"
    assert [_essence(o) for o in final.output] == [_essence(o) for o in one.output]
    assert final.output[-1].type == ("message" if kind == "json_schema_text" else kind)


def test_text_format_json_schema_constrains_the_output(env) -> None:
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "unit", "schema": schema, "strict": True}
    r = respond(
        env,
        input=QUESTION,
        text={"format": fmt},
        temperature=0.7,
        max_output_tokens=40,
        reasoning=NO_THINK,
        extra_body={"seed": 5},
    )
    assert r.status == "completed" and json.loads(r.output_text)["unit"] in ("celsius", "fahrenheit")
    assert r.text.format.type == "json_schema" and r.text.format.name == "unit"


def test_previous_response_id_chains_store_get_and_delete(env) -> None:
    first = respond(
        env,
        input="The quick brown fox",
        max_output_tokens=5,
        temperature=0,
        reasoning=NO_THINK,
        instructions="Not carried over.",
    )
    second = respond(
        env,
        previous_response_id=first.id,
        input="def add(a, b):",
        max_output_tokens=5,
        temperature=0,
        reasoning=NO_THINK,
    )
    history = [
        {"role": "user", "content": "The quick brown fox"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "def add(a, b):"},
    ]
    assert second.usage.input_tokens == prompt_tokens(env, history, enable_thinking=False)
    third = respond(
        env,
        previous_response_id=second.id,
        input="The quick",
        max_output_tokens=3,
        temperature=0,
        reasoning=NO_THINK,
    )
    history += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "The quick"},
    ]
    assert third.usage.input_tokens == prompt_tokens(env, history, enable_thinking=False)
    listed = env["sdk"].responses.input_items.list(second.id)  # newest first
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [
        ("message", "user", "def add(a, b):"),
        ("message", "assistant", first.output_text),
        ("message", "user", "The quick brown fox"),
    ]
    assert listed.data[1].id == first.output[0].id and not listed.has_more
    page = env["sdk"].responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in listed.data[::-1][:2]] and page.has_more
    rest = env["sdk"].responses.input_items.list(second.id, order="asc", limit=2, after=page.data[-1].id)
    assert [i.id for i in rest.data] == [listed.data[0].id] and not rest.has_more
    r = httpx.get(f"{env['server'].url}/v1/responses/{second.id}/input_items", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    got = env["sdk"].responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text and got.usage == second.usage
    env["sdk"].responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        env["sdk"].responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError) as missing:
        respond(env, previous_response_id=second.id, input="x", max_output_tokens=2)
    assert (
        missing.value.code == "previous_response_not_found" and missing.value.param == "previous_response_id"
    )
    unstored = respond(env, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        env["sdk"].responses.retrieve(unstored.id)
    # past http.responses_store_bytes the oldest entries are dropped first
    latest = [
        respond(env, input="The quick brown fox " * 20, max_output_tokens=2, reasoning=NO_THINK)
        for _ in range(STORE_BYTES // 800 // 2)
    ]
    with pytest.raises(openai.NotFoundError):
        env["sdk"].responses.retrieve(first.id)
    assert env["sdk"].responses.retrieve(latest[-1].id).id == latest[-1].id


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


def test_litellm_thinking_history_is_accepted_and_rendered(env) -> None:
    """Chat history as LiteLLM forwards an Anthropic model's turns: ``thinking_blocks`` beside the content (with
    signatures, redacted blocks) or ``thinking`` content parts; the thinking reaches the template's reasoning.
    A Responses reasoning item before an assistant message does the same."""
    blocks = [
        {"type": "thinking", "thinking": "The user greets me.", "signature": "EqQBCgIYAhIM"},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
    ]
    as_blocks = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Hello!", "thinking_blocks": blocks},
    ]
    as_parts = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "The user greets me.", "signature": "EqQBCgIYAhIM"},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
                {"type": "text", "text": "Hello!"},
            ],
        },
    ]
    rendered = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."},
    ]
    want = prompt_tokens(env, rendered, enable_thinking=False)
    assert want > prompt_tokens(
        env, rendered[:1] + [{"role": "assistant", "content": "Hello!"}], enable_thinking=False
    )
    for messages in (as_blocks, as_parts):
        r = env["sdk"].chat.completions.create(
            model=env["model"],
            messages=messages,
            max_tokens=2,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert r.usage.prompt_tokens == want
    items = [
        {"role": "user", "content": QUESTION},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "The user greets me."}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
    ]
    assert respond(env, input=items, max_output_tokens=2, reasoning=NO_THINK).usage.input_tokens == want


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
