"""The one decision of a request's sampling and generation limit (``serve/generation.py``): the defaults each
omitted key takes, the limit fitted to the prompt, and errors named by the right parameter."""

from __future__ import annotations

import json

import pytest

from dgpp.sample.params import SamplingDefaults, SamplingParams
from dgpp.serve.errors import APIError
from dgpp.serve.generation import fit_to_prompt, named_max_tokens, sampling_params
from dgpp.serve.protocol import ChatCompletionRequest, CompletionRequest
from dgpp.serve.validate import parse_body

CHECKPOINT = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1)


def chat(**body: object) -> ChatCompletionRequest:
    req, _ = parse_body(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}).encode(),
        ChatCompletionRequest,
    )
    return req


def legacy(**body: object) -> CompletionRequest:
    req, _ = parse_body(json.dumps({"model": "m", "prompt": "hi", **body}).encode(), CompletionRequest)
    return req


def test_omitted_keys_take_the_checkpoint_defaults_and_the_neutral_penalties() -> None:
    p = sampling_params(chat(), CHECKPOINT, vocab_size=100, default_max_tokens=77)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.95, 20, 0.05, 1.1)
    assert (p.presence_penalty, p.frequency_penalty, p.seed, p.logit_bias) == (0.0, 0.0, None, {})
    assert (p.max_tokens, p.logprobs, p.top_logprobs, p.stop, p.ignore_eos) == (77, False, 0, (), False)
    null = sampling_params(chat(temperature=None, top_k=None), CHECKPOINT, 100, 77)
    assert (null.temperature, null.top_k) == (0.6, 20)  # null is omitted
    assert sampling_params(chat(), SamplingDefaults(), 100, 77) == SamplingParams(max_tokens=77)


def test_named_keys_win_and_top_p_zero_is_greedy() -> None:
    p = sampling_params(
        chat(temperature=0, top_k=0, min_p=0, presence_penalty=0.5, stop="x", max_completion_tokens=5),
        CHECKPOINT,
        100,
        77,
    )
    assert (p.temperature, p.top_k, p.min_p, p.presence_penalty, p.stop, p.max_tokens) == (
        0,
        0,
        0,
        0.5,
        ("x",),
        5,
    )
    g = sampling_params(chat(top_p=0.0), CHECKPOINT, 100, 77)
    assert (g.top_p, g.top_k, g.greedy) == (1.0, 1, True)


def test_the_named_limit_of_each_api() -> None:
    assert named_max_tokens(chat()) is None
    assert named_max_tokens(chat(max_tokens=3)) == 3
    assert named_max_tokens(chat(max_completion_tokens=4)) == 4  # also a Responses max_output_tokens
    assert named_max_tokens(legacy()) is None
    assert named_max_tokens(legacy(max_tokens=0)) == 0  # score the prompt only: answered by the route
    assert sampling_params(legacy(max_tokens=0), CHECKPOINT, 100, 77).max_tokens == 77
    assert sampling_params(legacy(max_tokens=9), CHECKPOINT, 100, 77).max_tokens == 9


def test_legacy_logprobs_and_best_of_ranking() -> None:
    assert sampling_params(legacy(), CHECKPOINT, 100, 7).logprobs is False
    p = sampling_params(legacy(logprobs=2), CHECKPOINT, 100, 7)
    assert (p.logprobs, p.top_logprobs) == (True, 2)
    r = sampling_params(legacy(), CHECKPOINT, 100, 7, ranked=True)
    assert (r.logprobs, r.top_logprobs) == (True, 0)


def test_logit_bias_errors_name_logit_bias() -> None:
    assert sampling_params(chat(logit_bias={"3": 2}), CHECKPOINT, 100, 7).logit_bias == {3: 2.0}
    for bias in ({"x": 1}, {"100": 1}, {"3": 1, "03": 2}):
        with pytest.raises(APIError) as e:
            sampling_params(chat(logit_bias=bias), CHECKPOINT, 100, 7)
        assert (e.value.status, e.value.param) == (400, "logit_bias")


def fit(params: SamplingParams, prompt: int, named: bool, **kw: object) -> SamplingParams:
    return fit_to_prompt(
        params, prompt, max_position=100, kv_pool_tokens=80, named=named, prompt_param="messages", **kw
    )


def test_an_unnamed_limit_is_cut_to_the_room_the_prompt_leaves() -> None:
    assert fit(SamplingParams(max_tokens=50), 20, named=False).max_tokens == 50
    assert fit(SamplingParams(max_tokens=500), 20, named=False).max_tokens == 60  # KV pool 80 - 20
    assert fit(SamplingParams(max_tokens=500), 79, named=False).max_tokens == 1
    with pytest.raises(APIError) as e:
        fit(SamplingParams(max_tokens=500), 80, named=False)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "messages")


def test_a_named_limit_that_does_not_fit_is_refused_on_max_tokens() -> None:
    assert fit(SamplingParams(max_tokens=60), 20, named=True).max_tokens == 60
    with pytest.raises(APIError) as e:
        fit(SamplingParams(max_tokens=61), 20, named=True)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens")
    assert "KV pool of 80" in str(e.value)
    with pytest.raises(APIError) as e:
        fit_to_prompt(
            SamplingParams(max_tokens=90),
            20,
            max_position=100,
            kv_pool_tokens=1000,
            named=True,
            prompt_param="prompt",
        )
    assert (e.value.param, "model's context of 100" in str(e.value)) == ("max_tokens", True)


def test_a_grammar_cannot_ignore_eos() -> None:
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    assert fit(p, 1, named=True).ignore_eos is True
    assert fit(p, 1, named=True, constrained=True).ignore_eos is False
