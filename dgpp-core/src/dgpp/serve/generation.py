"""The one place a request's generation is decided, at the HTTP edge: its ``GenerationRequest``, built once and
handed to ``Backend.submit`` as is.

Chat completions, legacy completions and the Responses API (converted to a chat body first) all build their
``SamplingParams`` with ``sampling_params``; ``generation_request`` checks the prompt against the model and fits
the limit to it (``fit_to_prompt``). Every default is taken here: the checkpoint's ``SamplingDefaults``
(temperature, top_p, top_k, min_p, repetition_penalty) for what the request omitted, ``SamplingParams``' neutral
value for the penalties, ``engine.default_max_tokens`` for an unnamed limit, cut to the room the prompt leaves."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dgpp.media.prompt import PromptMedia
from dgpp.sample.params import SamplingDefaults, SamplingParams
from dgpp.sched.thread_handoff import GenerationRequest
from dgpp.serve.errors import APIError, invalid
from dgpp.serve.protocol import ChatCompletionRequest, CompletionRequest

NEUTRAL = SamplingParams()  # the value of each knob that has no checkpoint default and the request omitted


@dataclass(frozen=True)
class ModelLimits:
    """What the served model can hold: its vocabulary, its position ceiling and the KV pool's tokens."""

    vocab_size: int
    max_position: int
    kv_pool_tokens: int

    @property
    def request_limit_tokens(self) -> int:
        return min(self.max_position, self.kv_pool_tokens)


def generation_request(
    kind: str,
    prompt_ids: list[int],
    params: SamplingParams,
    limits: ModelLimits,
    *,
    named_limit: bool,
    token_text: Callable[[int], str],
    n: int = 1,
    use_prefix_cache: bool = True,
    matchers: list[Any] | None = None,
    constraint: dict[str, Any] | None = None,
    forced_tokens: list[int] | None = None,
    media: PromptMedia | None = None,
) -> GenerationRequest:
    """The request as the engine will run it, id ``{kind}-{random}``; 400 for a prompt the model cannot take
    (empty, or holding an id past its vocabulary, named by ``token_text``) or cannot fit with its limit.
    ``named_limit``: the request named its ``max_tokens``."""
    param = "messages" if kind == "chatcmpl" else "prompt"
    if not prompt_ids:  # a model step needs at least one token: an empty prompt would fail the step loop
        raise APIError(
            400, "the prompt is empty after rendering and tokenization", "invalid_parameter", param
        )
    top = max(prompt_ids)
    if top >= limits.vocab_size:  # a tokenizer with more (added) tokens than the model's embedding rows
        raise APIError(
            400,
            f"the prompt holds token id {top} ({token_text(top)!r}), past the "
            f"model's vocabulary of {limits.vocab_size}",
            "invalid_parameter",
            param,
        )
    params = fit_to_prompt(
        params,
        len(prompt_ids),
        max_position=limits.max_position,
        kv_pool_tokens=limits.kv_pool_tokens,
        named=named_limit,
        prompt_param=param,
        constrained=bool(matchers),
    )
    return GenerationRequest(
        f"{kind}-{secrets.token_hex(8)}",
        tuple(prompt_ids),
        params,
        n,
        use_prefix_cache,
        tuple(matchers) if matchers else None,
        constraint if matchers else None,
        tuple(forced_tokens) if forced_tokens is not None else None,
        media,
    )


def named_max_tokens(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The generation limit the request named (chat: ``max_completion_tokens`` or ``max_tokens``; a Responses
    request's ``max_output_tokens`` arrives as ``max_completion_tokens``), or None."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    defaults: SamplingDefaults,
    vocab_size: int,
    default_max_tokens: int,
    *,
    ranked: bool = False,
) -> SamplingParams:
    """The request's sampling, with the checkpoint's defaults for what it omitted (or sent as null) and
    ``default_max_tokens`` where it named no limit. ``ranked`` (legacy ``best_of`` > ``n``): each candidate's
    cumulative logprob ranks it, so logprobs are on."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise invalid(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise invalid(
                f"logit_bias token id {tid} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias"
            )
        if tid in bias:
            raise invalid(f"logit_bias names token id {tid} twice", "logit_bias")
        bias[tid] = float(value)
    # a legacy max_tokens of 0 (nothing generated) never reaches the engine; the route answers it
    max_tokens = named_max_tokens(req) or default_max_tokens
    if isinstance(req, ChatCompletionRequest):
        want_logprobs, top = bool(req.logprobs), req.top_logprobs or 0
    else:
        want_logprobs, top = req.logprobs is not None, req.logprobs or 0
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    greedy_by_top_p = req.top_p == 0.0  # top_p 0 keeps only the most likely token: greedy, via top_k 1
    top_p = 1.0 if greedy_by_top_p else req.top_p
    top_k = 1 if greedy_by_top_p else req.top_k
    d = defaults  # the checkpoint's value of each key the request omitted (or sent as null)
    return SamplingParams(
        temperature=d.temperature if req.temperature is None else req.temperature,
        top_p=d.top_p if top_p is None else top_p,
        top_k=d.top_k if top_k is None else top_k,
        min_p=d.min_p if req.min_p is None else req.min_p,
        repetition_penalty=d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=NEUTRAL.presence_penalty if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=NEUTRAL.frequency_penalty
        if req.frequency_penalty is None
        else req.frequency_penalty,
        seed=req.seed,
        logit_bias=bias,
        logprobs=want_logprobs or ranked,
        top_logprobs=top,
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=req.ignore_eos,
    )


def fit_to_prompt(
    params: SamplingParams,
    prompt_tokens: int,
    *,
    max_position: int,
    kv_pool_tokens: int,
    named: bool,
    prompt_param: str,
    constrained: bool = False,
) -> SamplingParams:
    """The final parameters for a prompt of ``prompt_tokens``: an unnamed limit is cut to the room the prompt
    leaves (400 on ``prompt_param`` when it leaves none); a named one that does not fit is refused (the client
    asked for something impossible), on ``max_tokens``. ``constrained``: a grammar ends with EOS, so EOS
    cannot be ignored."""
    if constrained:
        params = replace(params, ignore_eos=False)
    limit = min(max_position, kv_pool_tokens)
    if not named:
        room = limit - prompt_tokens
        if room < 1:
            raise APIError(
                400,
                f"the prompt ({prompt_tokens} tokens) leaves no room to generate within {limit} tokens",
                "context_length_exceeded",
                prompt_param,
            )
        params = replace(params, max_tokens=min(params.max_tokens, room))
    total = prompt_tokens + params.max_tokens
    for bound, what in ((max_position, "model's context"), (kv_pool_tokens, "KV pool")):
        if total > bound:
            where = " (engine.kv_capacity)" if what == "KV pool" else ""
            raise APIError(
                400,
                f"prompt ({prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"{what} of {bound} tokens{where}",
                "context_length_exceeded",
                "max_tokens",
            )
    return params
