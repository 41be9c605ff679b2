"""JSON shapes of responses and SSE chunks, for chat and legacy completions."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from dgpp.serve.logprobs import chat_logprobs, legacy_logprobs
from dgpp.serve.output_processor import OutputProcessor


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else msgspec.json.encode(data).decode()
    return f"data: {payload}\n\n".encode()


KEEP_ALIVE = b": keep-alive\n\n"
OBFUSCATION_BUCKET = 128


def _padding(size: int) -> str:
    """Random characters that bring a ``size``-byte event to a multiple of 128 bytes, at least 16 of them,
    so event sizes do not reveal token lengths."""
    n = 16 + (-(size + 16)) % OBFUSCATION_BUCKET
    return secrets.token_hex(n // 2 + 1)[:n]


DONE = sse("[DONE]")


def usage(prompt_tokens: int, outputs: list[OutputProcessor]) -> dict[str, Any]:
    completion = sum(o.completion_tokens for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": outputs[0].cached_tokens if outputs else 0},
        "completion_tokens_details": {"reasoning_tokens": sum(o.reasoning_tokens for o in outputs)},
    }


def timings(choice: OutputProcessor) -> dict[str, Any]:
    """llama.cpp-style ``timings`` of choice 0 (a DGPP extension): prompt work (what the prefix cache did not
    cover) from admission to the first token, generation from the first token to the last, as of the choice's
    latest event."""
    t = choice.timing
    completion_tokens = choice.completion_tokens
    prompt_n = t.prompt_tokens - t.cached_tokens if t else 0
    first, last, admitted = (t.first_token_at, t.last_token_at, t.admitted_at) if t else (None, None, None)
    prompt_ms = ((first or 0.0) - (admitted or 0.0)) * 1000.0 if first else 0.0
    predicted_ms = ((last or 0.0) - (first or 0.0)) * 1000.0 if last else 0.0
    predicted_n = max(completion_tokens - 1, 0)  # the first token belongs to the prompt's forward
    return {
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms else 0.0,
        "cache_n": t.cached_tokens if t else 0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000.0 * predicted_n / predicted_ms if predicted_ms else 0.0,
    }


class ChunkWriter:
    """Builds the SSE chunks of one streamed request (chat or legacy)."""

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        chat: bool,
        include_usage: bool,
        obfuscate: bool = False,
        service_tier: bool = False,
    ) -> None:
        self.base = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        if service_tier:
            self.base["service_tier"] = "default"
        self.chat = chat
        self.include_usage = include_usage
        self.obfuscate = obfuscate and chat
        self._preamble_sent: set[int] = set()
        self._text_offset: dict[int, int] = {}

    def _chunk(self, choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        body = {**self.base, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        if extra:
            body.update(extra)
        return self._event(body)

    def _event(self, body: dict[str, Any]) -> bytes:
        if self.obfuscate:
            body["obfuscation"] = _padding(len(msgspec.json.encode({**body, "obfuscation": ""})))
        return sse(body)

    def preamble(self, index: int) -> bytes:
        """The lazy role chunk, written once per choice just before its first real output."""
        if not self.chat or index in self._preamble_sent:
            return b""
        self._preamble_sent.add(index)
        return self._chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def delta(
        self,
        index: int,
        parts: list[dict[str, Any]],
        logprobs: list[dict[str, Any]],
        finish_reason: str | None,
        timings: dict[str, Any] | None = None,
    ) -> bytes:
        """Chunks for one event of one choice: one per delta part (logprobs ride on the first, or on an
        empty delta), then the terminal chunk when the choice finished."""
        out = b""
        if not self.chat:
            text = "".join(p.get("content", "") for p in parts)
            if text or logprobs:
                out += self._legacy(index, text, logprobs, None)
            if finish_reason is not None:
                out += self._legacy(index, "", [], finish_reason, timings)
            return out
        if logprobs and not parts:
            parts = [{}]
        for i, part in enumerate(parts):
            out += self.preamble(index)
            lp = chat_logprobs(logprobs) if logprobs and i == 0 else None
            out += self._chunk([{"index": index, "delta": part, "logprobs": lp, "finish_reason": None}])
        if finish_reason is not None:
            out += self.preamble(index)
            out += self._chunk(
                [{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}],
                {"timings": timings} if timings else None,
            )
        return out

    def echo(self, index: int, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        """A legacy stream's first chunk of a choice under ``echo``: the prompt (and its logprobs)."""
        return self._legacy(index, text, logprobs, None)

    def _legacy(
        self,
        index: int,
        text: str,
        logprobs: list[dict[str, Any]],
        finish: str | None,
        timings: dict[str, Any] | None = None,
    ) -> bytes:
        start = self._text_offset.get(index, 0)
        self._text_offset[index] = start + len(text)
        lp = legacy_logprobs(logprobs, start) if logprobs else None
        return self._chunk(
            [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}],
            {"timings": timings} if timings else None,
        )

    def usage_chunk(self, prompt_tokens: int, outputs: list[OutputProcessor]) -> bytes:
        return self._event({**self.base, "choices": [], "usage": usage(prompt_tokens, outputs)})

    @staticmethod
    def error(message: str, code: str = "engine_failure") -> bytes:
        return sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


def chat_response(
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    outputs: list[OutputProcessor],
    want_logprobs: bool,
    metadata: dict | None,
    service_tier: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": o.index,
                "message": o.message(),
                "logprobs": chat_logprobs(o.logprobs) if want_logprobs else None,
                "finish_reason": o.finish_reason,
            }
            for o in outputs
        ],
        "usage": usage(prompt_tokens, outputs),
    }
    if metadata:
        body["metadata"] = metadata
    if service_tier:
        body["service_tier"] = "default"
    return body
