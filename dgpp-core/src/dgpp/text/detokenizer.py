"""Incremental detokenization for streaming: whole UTF-8 characters only, stop strings held back and matched exactly."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass

from dgpp.text.tokenizer import Tokenizer


def held_prefix_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers`` (text that must
    wait for the next token before it can be released)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[len(text) - k :]):
                longest = k
                break
    return longest


@dataclass(frozen=True)
class StopMatch:
    """Where a stop string matched: ``stop`` is the string, ``token_index`` the 0-based index (among the pushed
    tokens) of the token that completed it, ``text`` everything visible before the stop string."""

    stop: str
    token_index: int
    text: str


class _BytesDecoder:
    """Byte-level tokenizers: token -> bytes -> an incremental UTF-8 decoder (exact, O(1) per token)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._table = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        # ids past the tokenizer (a model's padded vocabulary rows) have no text
        return self._utf8.decode(self._table[token_id] if token_id < len(self._table) else b"")

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowDecoder:
    """Any other decoder: re-decode a short window and emit what it adds once it no longer ends in U+FFFD."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: earlier text is final
        self._read = 0  # ids up to here are already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an unfinished character (or nothing new yet): wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class IncrementalDetokenizer:
    """Turns one request's generated ids into text chunks as they arrive.

    It never emits part of a UTF-8 character (an unfinished tail is held back, and becomes U+FFFD only at
    ``finish``), and it holds back any tail that could be the start of a stop string. When a stop string
    matches, ``push`` returns the text before it, ``stopped`` records the match, and later pushes return "".
    ``skip_ids`` are ids that produce no text (e.g. EOS, BOS, pad); ``spaced_ids`` are ids whose text is set
    apart by a space from the text before and after it (vLLM's ``spaces_between_special_tokens``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Iterable[str] = (),
        skip_ids: Iterable[int] = (),
        spaced_ids: Iterable[int] = (),
    ) -> None:
        self._decoder = _BytesDecoder(tokenizer) if tokenizer.is_byte_level else _WindowDecoder(tokenizer)
        self.stop_strings = tuple(s for s in stop if s)
        self._skip = frozenset(skip_ids)
        self._spaced = frozenset(spaced_ids)
        self._space_next = False  # the last id was a spaced one: text after it starts with a space
        self._pending = ""  # decoded but held back: a possible stop-string prefix
        self._count = 0
        self.text = ""  # everything emitted so far
        self.stopped: StopMatch | None = None
        # the text the last pushed id added (before stop-string hold-back): a logprob entry's token, so that
        # the entries join to the returned text (a hidden id adds "", an unfinished character waits)
        self.last_piece = ""

    @property
    def num_tokens(self) -> int:
        return self._count

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly visible text (maybe "")."""
        self.last_piece = ""
        if self.stopped is not None:
            return ""
        self._count += 1
        if token_id in self._skip:
            return ""
        piece = self._decoder.push(token_id)
        if self._spaced:
            spaced = token_id in self._spaced
            if piece and (spaced or self._space_next) and (self.text or self._pending):
                piece = " " + piece
            self._space_next = spaced or (self._space_next and not piece)
        self.last_piece = piece
        return self._release(self._pending + piece)

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def finish(self) -> str:
        """End of generation: flush the held-back text (an unfinished character becomes U+FFFD)."""
        self.last_piece = ""
        if self.stopped is not None:
            return ""
        self.last_piece = self._decoder.flush()  # an unfinished character's U+FFFD: the last id's text
        return self._release(self._pending + self.last_piece, final=True)

    def _release(self, text: str, final: bool = False) -> str:
        if self.stop_strings:
            hit = self._first_stop(text)
            if hit is not None:
                at, stop = hit
                out = text[:at]
                self.text += out
                self._pending = ""
                self.stopped = StopMatch(stop=stop, token_index=self._count - 1, text=self.text)
                return out
        keep = 0 if final else held_prefix_length(text, self.stop_strings)
        out, self._pending = text[: len(text) - keep], text[len(text) - keep :]
        self.text += out
        return out

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop-string occurrence (the longest stop wins a tie at one position)."""
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1]))):
                best = (at, stop)
        return best
