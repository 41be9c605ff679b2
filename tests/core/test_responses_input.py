"""Responses input items and options -> the chat request the chat route serves."""

from __future__ import annotations

import msgspec
import pytest

from dgpp.serve.errors import APIError
from dgpp.serve.responses_input import chat_body, chat_messages, chat_tool_choice, chat_tools, renamed
from dgpp.serve.responses_protocol import ResponsesRequest


def test_one_turn_of_reasoning_text_and_calls_is_one_assistant_message() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "short"}],
            "content": [{"type": "reasoning_text", "text": "I should call it."}],
        },
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": "{}",
        },
        {"type": "custom_tool_call", "call_id": "call_b", "name": "note", "input": "hi"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {
            "type": "custom_tool_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "ok"}],
        },
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "only a summary"}]},
    ]
    assert chat_messages(items, model="m") == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "reasoning_content": "I should call it.",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "call_b", "type": "custom", "custom": {"name": "note", "input": "hi"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "input_text", "text": "ok"}]},
        {"role": "assistant", "content": "", "reasoning_content": "only a summary"},
    ]


def test_an_assistant_message_after_calls_starts_a_new_turn() -> None:
    items = [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": "after"},
    ]
    assert [m.get("tool_calls") is not None for m in chat_messages(items, model="m")] == [True, False]


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("text", "input[1] must be an object"),
        ({"role": "tool", "content": "x"}, "input[1].role 'tool'"),
        ({"role": "user", "content": 3}, "input[1].content must be a string or an array"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]},
            "input_image part; model 'm'",
        ),
        (
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}},
            "input[1].arguments must be a string",
        ),
        ({"type": "function_call_output", "output": "x"}, "input[1].call_id must be a non-empty string"),
        ({"type": "reasoning", "content": "x"}, "input[1].content must be an array of reasoning_text parts"),
        ({"type": "item_reference", "id": "msg_1"}, "of type 'item_reference' is not supported"),
    ],
)
def test_bad_items_are_named_by_their_place_in_input(item, named) -> None:
    previous = [{"role": "user", "content": "earlier"}]  # a stored conversation's items do not count
    with pytest.raises(APIError) as err:
        chat_messages([*previous, {"role": "user", "content": "ok"}, item], first_input=1, model="m")
    assert named in err.value.message and err.value.param == "input" and err.value.status == 400


def test_options_map_to_the_chat_request() -> None:
    req = msgspec.convert(
        {
            "model": "m",
            "input": "hi",
            "instructions": "sys",
            "max_output_tokens": 5,
            "top_logprobs": 2,
            "reasoning": {"effort": "low", "summary": "auto"},
            "seed": 3,
            "ignore_eos": True,
            "text": {
                "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
            },
            "tools": [
                {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False},
                {
                    "type": "custom",
                    "name": "g",
                    "format": {"type": "grammar", "syntax": "regex", "definition": "a+"},
                },
            ],
            "tool_choice": {"type": "custom", "name": "g"},
        },
        ResponsesRequest,
    )
    body = chat_body(req, [{"role": "user", "content": "hi"}])
    assert body["messages"][0] == {"role": "system", "content": "sys"}
    assert body["max_completion_tokens"] == 5 and body["logprobs"] is True and body["top_logprobs"] == 2
    assert body["reasoning_effort"] == "low" and body["seed"] == 3 and body["ignore_eos"] is True
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
    }
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": False}},
        {
            "type": "custom",
            "custom": {
                "name": "g",
                "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": "a+"}},
            },
        },
    ]
    assert body["tool_choice"] == {"type": "custom", "custom": {"name": "g"}}
    assert (
        "temperature" not in body and "stream" not in body
    )  # omitted stays omitted: the model's defaults apply


def test_tools_and_choices_this_server_cannot_serve_are_refused_by_name() -> None:
    with pytest.raises(APIError) as err:
        chat_tools([{"type": "function", "name": "f"}, {"type": "file_search", "vector_store_ids": []}])
    assert err.value.param == "tools[1].type"
    with pytest.raises(APIError) as err:
        chat_tool_choice({"type": "mcp", "server_label": "x"})
    assert err.value.param == "tool_choice"
    assert chat_tool_choice(
        {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "f"}]}
    ) == {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "name": "f"}]},
    }


@pytest.mark.parametrize(
    ("chat_param", "named"),
    [
        ("messages", "input"),
        ("messages[3].content", "input"),
        ("max_completion_tokens", "max_output_tokens"),
        ("max_tokens", "max_output_tokens"),
        ("prompt", "input"),
        ("response_format.json_schema", "text.format.json_schema"),
        ("reasoning_effort", "reasoning.effort"),
        ("tools[0]", "tools[0]"),
        (None, None),
    ],
)
def test_errors_on_the_chat_request_name_the_responses_parameter(chat_param, named) -> None:
    assert renamed(APIError(400, "x", "invalid_parameter", chat_param)).param == named
