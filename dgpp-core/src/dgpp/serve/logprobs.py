"""Logprob entries in OpenAI's chat shape (``LogprobEntries``), and the chat and legacy ``logprobs`` objects built
from them."""

from __future__ import annotations

from typing import Any

REASONING = "reasoning"  # marks a logprob entry of a reasoning token until chat_logprobs places it


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
