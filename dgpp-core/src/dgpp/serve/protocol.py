"""Request bodies of the OpenAI-compatible routes, as msgspec Structs (types and ranges by field name).

Unknown top-level fields are refused by name (``http.allow_unknown_fields`` ignores them instead), and so are
the fields in ``REJECTED`` / ``REJECTED_WHEN_SET``. ``null`` counts as omitted for nullable options.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=100.0)]
Seed = Annotated[int, msgspec.Meta(ge=I64_MIN, le=I64_MAX)]
StopString = Annotated[str, msgspec.Meta(min_length=1)]
Stop = StopString | Annotated[list[StopString], msgspec.Meta(min_length=1, max_length=4)]
# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512
Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=16),
]
SafetyIdentifier = Annotated[str, msgspec.Meta(max_length=64)]

# Chat fields refused whatever their value, and those refused unless null (features this server lacks).
REJECTED = ("web_search_options", "functions", "function_call", "prompt_cache_options")
REJECTED_WHEN_SET = (
    "audio",
    "prediction",
    "moderation",
    "prompt_cache_key",
    "prompt_cache_retention",
    "verbosity",
)
# Fields popular clients send that mean nothing here and change no answer: accepted and ignored even though
# unknown fields are refused (OpenCode sends ``preserveThinking`` with every chat request).
IGNORED_EXTENSIONS = ("preserveThinking",)
# Legacy completions fields refused whatever their value (``logprobs`` is the legacy route's top count).
COMPLETION_REJECTED = ("top_logprobs",)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool = True  # chat streams pad each event; legacy streams never do


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields both routes share."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    min_p: Unit | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]], msgspec.Meta(max_length=1024)
        ]
        | None
    ) = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    prefix_cache: bool = True
    sse_ping_interval: Annotated[int, msgspec.Meta(ge=-1, le=86400)] | None = None  # seconds; a day at most
    skip_special_tokens: bool = True  # vLLM's and SGLang's default: <|im_end|> and the like give no text
    spaces_between_special_tokens: bool = True


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[Any], msgspec.Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=128)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: SafetyIdentifier | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any  # a string, strings, token ids or token-id arrays: dgpp.serve.legacy.split_prompts checks it
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None  # 0: score the prompt only
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    echo: bool = False
    suffix: str | None = None
    user: str | None = None
