"""Malformed chat messages are refused naming the message (a 400), not rendered as whatever str() makes of them."""

from __future__ import annotations

import pytest

from dgpp.text.chat_template import prepare_messages
from dgpp.text.errors import TemplateError


@pytest.mark.parametrize(
    ("message", "named"),
    [
        ({"role": "user", "content": 5}, "messages[0].content must be a string or an array"),
        ({"role": "system", "content": {"text": "x"}}, "messages[0].content must be a string or an array"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text must be a string"),
        (
            {"role": "user", "content": [{"type": "text", "text": 7}]},
            "messages[0].content[0].text must be a string",
        ),
        ({"role": "assistant", "tool_calls": "abc"}, "messages[0].tool_calls must be an array"),
        ({"role": "assistant", "tool_calls": {"id": "a"}}, "messages[0].tool_calls must be an array"),
        (
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]},
            "messages[0].tool_calls[0].function must be an object",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "a", "type": "function", "function": {"arguments": "{}"}}],
            },
            "messages[0].tool_calls[0] needs a tool name",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "custom", "custom": {"input": "x"}}]},
            "messages[0].tool_calls[0] needs a tool name",
        ),
        (
            {"role": "assistant", "content": "x", "thinking_blocks": "t"},
            "messages[0].thinking_blocks must be an array",
        ),
        (
            {"role": "assistant", "content": "x", "thinking_blocks": [{"type": "text", "text": "t"}]},
            "messages[0].thinking_blocks[0] must be a thinking or redacted_thinking block",
        ),
    ],
)
def test_malformed_message_is_refused_by_position(message, named) -> None:
    with pytest.raises(TemplateError, match=named.replace("[", r"\[").replace("]", r"\]")):
        prepare_messages([message])


def test_well_formed_messages_still_pass() -> None:
    out = prepare_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "r"},
        ]
    )
    assert out[0]["content"] == "a\nb"
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": {"x": 1},
    }


def test_litellm_thinking_fields_become_reasoning_content() -> None:
    """LiteLLM forwards Anthropic thinking as ``thinking_blocks`` (and ``reasoning_content``) beside the content,
    or as ``thinking`` content parts; vLLM's newer responses name the field ``reasoning``."""
    blocks = [
        {"type": "thinking", "thinking": "step one. ", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "thinking", "thinking": "step two."},
    ]
    out = prepare_messages(
        [
            {"role": "assistant", "content": "a", "thinking_blocks": blocks},
            {"role": "assistant", "content": "b", "reasoning_content": "own", "thinking_blocks": blocks},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "parts", "signature": "s"},
                    {"type": "text", "text": "c"},
                ],
            },
            {"role": "assistant", "content": "d", "reasoning": "vllm"},
        ]
    )
    assert out[0] == {"role": "assistant", "content": "a", "reasoning_content": "step one. step two."}
    assert out[1]["reasoning_content"] == "own" and "thinking_blocks" not in out[1]
    assert out[2] == {"role": "assistant", "content": "c", "reasoning_content": "parts"}
    assert out[3]["reasoning_content"] == "vllm"
