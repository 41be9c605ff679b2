"""Legacy ``/v1/completions`` beyond one string prompt: token-id prompts, batches of prompts, ``echo``,
and the prompt's own logprobs (``echo`` with ``logprobs``, also with ``max_tokens: 0``), which
log-likelihood harnesses such as lm-evaluation-harness' ``local-completions`` score with.

Prompt logprobs come from a second sequence that walks the prompt one token per engine step with a
``ForcedSampler``: each step's logits row is the model's distribution for the next prompt token given the
ones before it (exact, the same numbers a prefill row gives), at the cost of one step per prompt token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dgpp.sample.params import SamplingParams
from dgpp.serve.backend import Backend, RequestHandle
from dgpp.serve.errors import APIError, invalid
from dgpp.serve.generation import generation_request
from dgpp.serve.logprobs import LogprobEntries, legacy_logprobs
from dgpp.serve.openai_format import usage
from dgpp.serve.output_processor import OutputProcessor
from dgpp.text.detokenizer import IncrementalDetokenizer

PROMPT_SHAPES = "a string, an array of strings, an array of token ids, or an array of token-id arrays"


@dataclass
class LegacyPrompt:
    """One prompt of a legacy request: its ids, the text ``echo`` repeats, and its logprob entries."""

    ids: list[int]
    text: str
    logprobs: list[dict[str, Any]] = field(default_factory=list)


def split_prompts(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    """The request's prompts, each a string or a list of token ids (OpenAI's four prompt shapes)."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid(f"prompt must be {PROMPT_SHAPES} (non-empty)", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_id(t) for t in prompt):
        return [_token_ids(prompt, vocab_size)]
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p, vocab_size) for p in prompt]
    raise invalid(f"prompt must be {PROMPT_SHAPES}; this array mixes them", "prompt")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(ids: list[Any], vocab_size: int) -> list[int]:
    if not ids:
        raise invalid("a token-id prompt must hold at least one id", "prompt")
    for t in ids:
        if not _is_id(t) or not 0 <= t < vocab_size:
            raise invalid(
                f"prompt token id {t!r} is not in this model's vocabulary (0..{vocab_size - 1})", "prompt"
            )
    return list(ids)


async def prepare_prompt(backend: Backend, prompt: str | list[int]) -> LegacyPrompt:
    if isinstance(prompt, str):
        return LegacyPrompt(await backend.prepare_text(prompt), prompt)
    return LegacyPrompt(prompt, backend.tokenizer.decode(prompt))


async def score_prompt(
    backend: Backend, prompt: LegacyPrompt, top: int, track: Callable[[RequestHandle], Any] | None = None
) -> None:
    """Fill ``prompt.logprobs``: one entry per prompt token, the first without a logprob (nothing predicts it).
    ``track`` is told the scoring walk's handle (so a client that hangs up stops it)."""
    entries = LogprobEntries(backend.tokenizer)
    ids = prompt.ids
    pieces = token_pieces(backend.tokenizer, ids)
    prompt.logprobs = [entries.entry(ids[0], None, None, pieces[0])]
    if len(ids) == 1:
        return
    # the walk's sampler (``ForcedSampler``, built on the step loop's thread) sets the same parameters
    forced = SamplingParams(
        temperature=0.0, logprobs=True, top_logprobs=top, max_tokens=len(ids) - 1, ignore_eos=True
    )
    walk = generation_request(
        "cmpl",
        ids[:1],
        forced,
        backend.limits,
        named_limit=True,
        token_text=backend.token_text,
        forced_tokens=ids[1:],
    )
    handle = backend.submit(walk)
    if track is not None:
        track(handle)
    try:
        async for _, ev in handle.events():
            at = len(prompt.logprobs)
            prompt.logprobs += [
                entries.entry(t, s.logprob, s.top_logprobs, piece)
                for t, s, piece in zip(ev.tokens, ev.samples, pieces[at : at + len(ev.tokens)], strict=True)
            ]
            if ev.error is not None:
                err = APIError(500, f"scoring the prompt failed: {ev.error}", "generation_failed")
                err.log_fields["completion_id"] = handle.request_id
                raise err
    finally:
        handle.cancel()
    if handle.cancelled:  # the client left: nobody reads the scores
        return
    if len(prompt.logprobs) != len(ids):  # a forced walk only ends early when the engine stops it
        raise APIError(
            500,
            f"scoring the prompt ended after {len(prompt.logprobs)} of {len(ids)} tokens",
            "generation_failed",
        )


def token_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """The text each of ``ids`` adds to their decoded text (a character split across tokens goes to the token that
    finishes it), so a prompt's logprob entries join to its echo."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = []
    for t in ids:
        detokenizer.push(t)
        pieces.append(detokenizer.last_piece)
    return pieces


def best_of(outputs: list[OutputProcessor], n: int) -> list[OutputProcessor]:
    """The ``n`` of one prompt's ``best_of`` candidates with the highest cumulative logprob, best first (ties to
    the lower index); all of them, in order, when there are no more than ``n``."""
    if len(outputs) <= n:
        return outputs
    return sorted(outputs, key=lambda o: (-o.cumulative_logprob, o.index))[:n]


def legacy_body(
    prompts: list[LegacyPrompt],
    outputs: list[list[OutputProcessor]],
    n: int,
    echo: bool,
    want_logprobs: bool,
    generated: list[OutputProcessor] | None = None,
) -> dict[str, Any]:
    """A one-shot ``text_completion`` body (without id, created, model): choice ``p * n + i`` is choice ``i``
    of prompt ``p``. Without outputs (``max_tokens: 0``) each choice is the echo alone, finished by length.
    ``usage`` counts every ``generated`` choice (``best_of`` candidates not returned included), as OpenAI bills."""
    choices = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            out = outputs[p][i] if outputs else None
            entries = (prompt.logprobs if echo else []) + (out.logprobs if out is not None else [])
            choices.append(
                {
                    "index": p * n + i,
                    "text": (prompt.text if echo else "") + (out.content if out is not None else ""),
                    "logprobs": legacy_logprobs(entries) if want_logprobs else None,
                    "finish_reason": out.finish_reason if out is not None else "length",
                }
            )
    flat = generated if generated is not None else [o for per_prompt in outputs for o in per_prompt]
    return {
        "object": "text_completion",
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(sum(len(p.ids) for p in prompts), flat),
    }
