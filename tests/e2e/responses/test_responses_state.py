"""End to end: stored responses (``previous_response_id`` chains, retrieve, input items, delete, the store's byte
budget) and conversation history with thinking, as LiteLLM forwards it to ``/v1/chat/completions`` and as
Responses reasoning items."""

from __future__ import annotations

import httpx
import openai
import pytest
from responses_client import NO_THINK, QUESTION, STORE_BYTES, prompt_tokens, respond

pytestmark = pytest.mark.e2e


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
