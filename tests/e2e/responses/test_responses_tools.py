"""End to end: ``POST /v1/responses`` tool calls (function and custom tools, forced, allowed, streamed) and their
outputs sent back, and a Codex-shaped agent request."""

from __future__ import annotations

import json

import pytest
from responses_client import CHAT_TOOL, NO_THINK, QUESTION, TOOL, prompt_tokens, respond

pytestmark = pytest.mark.e2e


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
