"""The body of ``POST /v1/responses`` (OpenAI's Responses API) as a msgspec Struct.

Every field OpenAI documents is named here; an unknown field is refused by name (a misspelt option is an
error, never silently ignored). Fields whose feature this server does not have are refused when set
(``REFUSED_WHEN_SET``). A few DGPP extensions of the chat route pass through unchanged (``CHAT_EXTENSIONS``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from dgpp.serve.protocol import (
    MaxTokens,
    Metadata,
    Penalty,
    RepetitionPenalty,
    SafetyIdentifier,
    Seed,
    Stop,
    Temperature,
    Unit,
)

# Responses fields for features this server has not got: refused unless null (or false for ``background``).
REFUSED_WHEN_SET = (
    "background",
    "background_options",
    "conversation",
    "prompt",
    "max_tool_calls",
    "prompt_cache_retention",
    "prompt_cache_options",
    "context_management",
    "moderation",
    "image",
    "access_programs",
)
# Chat-route options (DGPP/vLLM extensions) a Responses request may carry; they mean what they mean there.
CHAT_EXTENSIONS = (
    "chat_template_kwargs",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "ignore_eos",
    "prefix_cache",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "sse_ping_interval",
)


class ReasoningOptions(msgspec.Struct, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None  # accepted; the reasoning item carries the full reasoning text, not a summary
    generate_summary: str | None = None  # the older spelling of ``summary``
    context: str | None = None  # accepted; the chat template decides which turns' reasoning it renders


class TextOptions(msgspec.Struct, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; no template here takes it


class ResponseStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool = False  # accepted; Responses events are not padded


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[Any] = msgspec.field(default_factory=list)
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=128)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: Unit | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    store: bool | None = None  # OpenAI's default is true: null keeps the response
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: Metadata | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None
    safety_identifier: SafetyIdentifier | None = None
    prompt_cache_key: str | None = None  # a routing hint; the prefix cache here matches prompts by content
    service_tier: str | None = None
    # refused when set (REFUSED_WHEN_SET)
    background: bool | None = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    # chat-route extensions (CHAT_EXTENSIONS)
    chat_template_kwargs: dict[str, Any] | None = None
    seed: Seed | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    min_p: Unit | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stop: Stop | None = None
    ignore_eos: bool | None = None
    prefix_cache: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    sse_ping_interval: Annotated[int, msgspec.Meta(ge=-1, le=86400)] | None = None

    @property
    def keeps(self) -> bool:
        """Whether this response is stored for ``previous_response_id`` and ``GET /v1/responses/{id}``."""
        return self.store is not False
