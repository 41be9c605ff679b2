"""One served choice: scheduler events in, OpenAI deltas, logprobs and the finish reason out.

The text chain itself (detokenizer with stop strings, reasoning split, tool-call parsing) is
``dgpp.text.output.ChoiceOutput``; this adds what serving needs around it: token accounting against
logprob entries for visible tokens, and retirement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dgpp.sample.params import SamplingParams
from dgpp.sched.request import RetireReason, SeqEvent
from dgpp.text.output import ChoiceOutput

REASONING = "reasoning"  # marks a logprob entry of a reasoning token until chat_logprobs places it


@dataclass
class Delta:
    """What one event adds to a choice: OpenAI deltas, logprob entries, and maybe the finish."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_by_string: bool = False
    error: str | None = None


class ServedChoice:
    """Feeds one choice's token events through the text chain and keeps its totals."""

    def __init__(
        self,
        index: int,
        text: ChoiceOutput,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        eos_logprobs: bool = False,
    ) -> None:
        self.index = index
        self.text = text
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.eos_logprobs = eos_logprobs  # whether an EOS gets a logprob entry (legacy completions)
        self.completion_tokens = 0
        self.cumulative_logprob = 0.0  # of the generated tokens, when sampled with logprobs (ranks best_of)
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[dict[str, Any]] = []
        # entries of tokens the tool-call parser holds: dropped if they become a call (tool syntax is not
        # visible content), released in order if they turn out to be content
        self._held: list[dict[str, Any]] = []
        self._entries = LogprobEntries(tokenizer)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def content(self) -> str:
        return self.text.content

    @property
    def reasoning_tokens(self) -> int:
        return self.text.reasoning_tokens

    def message(self) -> dict[str, Any]:
        return self.text.message()

    def feed(self, ev: SeqEvent) -> Delta:
        delta = Delta()
        if self.finished:
            return delta
        self.cached_tokens = ev.cached_tokens
        for token, sample in zip(ev.tokens, ev.samples, strict=True):
            hidden = self.text.splitter.in_reasoning and not self.text.splitter.in_content
            parts = self.text.push(token)
            delta.parts += parts
            self.completion_tokens += 1
            if sample.logprob is not None:
                self.cumulative_logprob += sample.logprob
            stopped = self.text.stopped
            # logprobs describe generated tokens but a fully suppressed stop token and, in a chat, EOS; reasoning
            # ones are marked and go to ``logprobs.reasoning_content`` (``chat_logprobs``), as reasoning tokens go
            # to ``reasoning_content`` whether the template hides them or not
            eos_entry = self.eos_logprobs or token not in self.eos_token_ids
            if self.params.logprobs and eos_entry and (stopped is None or parts):
                entry = self._logprob_entry(token, sample)
                if hidden:
                    delta.logprobs.append({**entry, REASONING: True})
                else:
                    self._route_logprob(entry, parts, delta)
            if stopped is not None:
                # completion_tokens counts up to the token that completed the match
                self.completion_tokens = self.text.completion_tokens
                delta.stopped_by_string = True
                self._finish(delta, "stop")
                return delta
        if ev.error is not None:
            delta.error = self.error = ev.error
            self._finish(delta, "error")
        elif ev.retired is not None:
            # EOS ends a choice that made tool calls with "tool_calls"
            eos = ev.retired is RetireReason.EOS
            self._finish(delta, self.text.finish_reason("stop") if eos else ev.retired.finish_reason)
        else:
            self.logprobs.extend(delta.logprobs)
        return delta

    def _route_logprob(self, entry: dict[str, Any], parts: list[dict[str, Any]], delta: Delta) -> None:
        if any("tool_calls" in p for p in parts):  # the held block parsed as calls: its tokens were syntax
            self._held = []
        elif any("content" in p for p in parts):
            delta.logprobs += self._held + [entry]
            self._held = []
        elif self.text.holding_call_text:
            self._held.append(entry)
        else:
            delta.logprobs.append(entry)

    def _finish(self, delta: Delta, reason: str) -> None:
        tail = self.text.finish()
        flushed = self.text.last_piece  # an unfinished character ends the text as U+FFFD: the last entry's
        entries = delta.logprobs or self.logprobs or self._held
        if flushed and entries:
            entries[-1]["token"] += flushed
        delta.parts += tail
        if not any("tool_calls" in p for p in tail):  # a cut-off or malformed block flushes as content
            delta.logprobs += self._held
        self._held = []
        delta.finish_reason = self.finish_reason = reason
        self.logprobs.extend(delta.logprobs)

    def _logprob_entry(self, token: int, sample: Any) -> dict[str, Any]:
        return self._entries.entry(token, sample.logprob, sample.top_logprobs, self.text.last_piece)


class LogprobEntries:
    """Logprob entries ``{token, logprob, bytes, top_logprobs}`` in OpenAI's chat shape (the legacy shape is
    made from them by ``legacy_logprobs``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # a model's vocabulary is often padded past the tokenizer's: those ids have no text (the text chain
        # counts them as tokens) and no logprob bytes
        self._known = tokenizer.vocab_size

    def entry(
        self, token: int, logprob: float | None, top: list[tuple[int, float]] | None, text: str | None = None
    ) -> dict[str, Any]:
        """``top`` None gives ``top_logprobs: null`` (a prompt's first token, which nothing predicts). ``text`` is
        what the token added to the returned text (so the entries join to it; ``bytes`` stay the token's own),
        else its text decoded alone (the alternatives in ``top_logprobs``)."""
        return {
            "token": self.text(token) if text is None else text,
            "logprob": logprob,
            "bytes": list(self.bytes(token)),
            "top_logprobs": None
            if top is None
            else [{"token": self.text(t), "logprob": lp, "bytes": list(self.bytes(t))} for t, lp in top],
        }

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if token < self._known else ""

    def bytes(self, token: int) -> bytes:
        if token >= self._known:
            return b""
        if getattr(self.tokenizer, "is_byte_level", False):
            return self.tokenizer.token_bytes[token]
        return self.text(token).encode("utf-8")


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``{content, refusal}``, plus ``reasoning_content`` (a DGPP extension, as vLLM reports reasoning
    tokens' logprobs) when some entries are of reasoning tokens."""
    out: dict[str, Any] = {"content": [e for e in entries if REASONING not in e], "refusal": None}
    reasoning = [{k: v for k, v in e.items() if k != REASONING} for e in entries if REASONING in e]
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def legacy_logprobs(entries: list[dict[str, Any]], text_start: int = 0) -> dict[str, Any]:
    """``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`` of the legacy route."""
    offsets, at = [], text_start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": offsets,
    }
