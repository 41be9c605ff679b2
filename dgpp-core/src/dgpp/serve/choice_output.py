"""One choice's output as the client sees it: text deltas (stop strings cut exactly), logprobs, finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dgpp.sample.params import SamplingParams
from dgpp.sched.request import SeqEvent
from dgpp.text.detokenizer import IncrementalDetokenizer


@dataclass
class Delta:
    """What one event adds to a choice: visible text, logprob entries for it, and maybe the finish."""

    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_by_string: bool = False
    error: str | None = None


class ChoiceOutput:
    """Feeds a choice's token events through the incremental detokenizer and keeps its totals."""

    def __init__(self, index: int, tokenizer: Any, params: SamplingParams, eos_token_ids: frozenset[int]) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.detok = IncrementalDetokenizer(tokenizer, params.stop, skip_ids=eos_token_ids)
        self.text = ""
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list[dict[str, Any]] = []
        # a model's vocabulary is often padded past the tokenizer's: those ids have no text, and the
        # detokenizer never sees them; ``_pushed`` maps its token count back to ours for stop accounting
        self._known = tokenizer.vocab_size
        self._pushed: list[int] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ev: SeqEvent) -> Delta:
        delta = Delta()
        if self.finished:
            return delta
        self.cached_tokens = ev.cached_tokens
        for token, sample in zip(ev.tokens, ev.samples, strict=True):
            piece = ""
            if token < self._known:
                piece = self.detok.push(token)
                self._pushed.append(self.completion_tokens)
            self.completion_tokens += 1
            delta.text += piece
            if self.params.logprobs and token not in self.eos_token_ids and (piece or self.detok.stopped is None):
                delta.logprobs.append(self._logprob_entry(token, sample))
            if self.detok.stopped is not None:
                # completion_tokens counts up to the token that completed the match
                self.completion_tokens = self._pushed[self.detok.stopped.token_index] + 1
                delta.finish_reason = self.finish_reason = "stop"
                delta.stopped_by_string = True
                break
        if ev.error is not None and not self.finished:
            delta.error = ev.error
            delta.text += self.detok.finish()
            delta.finish_reason = self.finish_reason = "error"
        elif ev.retired is not None and not self.finished:
            delta.text += self.detok.finish()
            delta.finish_reason = self.finish_reason = ev.retired.finish_reason
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        return delta

    def _logprob_entry(self, token: int, sample: Any) -> dict[str, Any]:
        return {
            "token": self._token_text(token),
            "logprob": sample.logprob,
            "bytes": list(self._token_bytes(token)),
            "top_logprobs": [
                {"token": self._token_text(t), "logprob": lp, "bytes": list(self._token_bytes(t))}
                for t, lp in sample.top_logprobs
            ],
            "_id": token,
        }

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if token < self._known else ""

    def _token_bytes(self, token: int) -> bytes:
        if token >= self._known:
            return b""
        if getattr(self.tokenizer, "is_byte_level", False):
            return self.tokenizer.token_bytes[token]
        return self._token_text(token).encode("utf-8")


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": [{k: v for k, v in e.items() if k != "_id"} for e in entries], "refusal": None}


def legacy_logprobs(entries: list[dict[str, Any]], text_start: int = 0) -> dict[str, Any]:
    """``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`` of the legacy route."""
    offsets, at = [], text_start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }
