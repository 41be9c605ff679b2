"""Conversations the template tests render (OpenAI request shape), shared by the chat-template tests."""

from __future__ import annotations

import json

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def _call(call_id: str, name: str, args: dict) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


CONVERSATIONS: dict[str, tuple[list[dict], list[dict] | None]] = {
    "system_user": (
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "What is 2+2?"}],
        None,
    ),
    "no_system": ([{"role": "user", "content": "Hi 你好 😀"}], None),
    "multi_turn": (
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "one?"}],
            },
        ],
        None,
    ),
    "thinking_history": (
        [
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3 is 5."},
            {"role": "user", "content": "times 2?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "5*2=10"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {"type": "text", "text": "10"},
                ],
            },
        ],
        None,
    ),
    "tools": (
        [
            {"role": "system", "content": "Use tools when needed."},
            {"role": "user", "content": "Weather in Paris and the time?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    _call("call_1", "get_weather", {"city": "Paris", "days": 2}),
                    _call("call_2", "get_time", {}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
            {"role": "assistant", "content": "21 degrees at noon."},
            {"role": "user", "content": "Thanks. And Tokyo?"},
        ],
        [WEATHER_TOOL, TIME_TOOL],
    ),
    "tools_pending_result": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [_call("call_1", "get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        [WEATHER_TOOL],
    ),
}
THINKING_KWARGS = [{}, {"enable_thinking": True}, {"enable_thinking": False}]
