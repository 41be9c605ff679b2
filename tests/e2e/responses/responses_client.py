"""The requests the Responses tests share: the served engine's settings, the tool they call, and the calls that
send a request through the openai SDK or count a conversation's prompt tokens as the chat route renders it."""

from __future__ import annotations

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


def respond(env, **kw):
    return env["sdk"].responses.create(model=env["model"], **kw)


def prompt_tokens(env, messages, tools=None, **kwargs) -> int:
    return len(env["tok"].encode(env["template"].render(messages, tools, chat_template_kwargs=kwargs)))
