"""One choice's output: the scheduler's events in; OpenAI deltas, logprob entries, usage counts and the finish
reason out (``OutputProcessor.feed``, one per choice).

Per token, in order: the detokenizer (whole UTF-8 characters, stop strings held back and matched exactly), the
reasoning split (``reasoning_content`` before the dialect's end tag), and the family dialect's stream parser over
the content (tool calls as two deltas each, only when the request has tools). Logprob entries follow the text:
an entry describes what its token added to the visible output, reasoning entries are marked, and the entries of
text the tool-call parser holds wait until that text turns out to be a call (dropped) or content (released).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dgpp.sample.params import SamplingParams
from dgpp.sched.request import RetireReason, SeqEvent, SeqTiming
from dgpp.serve.logprobs import REASONING, LogprobEntries
from dgpp.text.detokenizer import IncrementalDetokenizer, held_prefix_length
from dgpp.text.dialect import Dialect, ToolCall
from dgpp.text.tools import tool_specs

THINK_TAGS = ("<think>", "</think>")  # a model without a dialect still splits at these


def prompt_opens_thinking(prompt: str, start_tag: str = THINK_TAGS[0]) -> bool:
    """True when the rendered prompt leaves a thinking block open for the model to continue."""
    return prompt.rstrip().endswith(start_tag)


@dataclass
class Delta:
    """What one event adds to a choice: OpenAI deltas, logprob entries, and maybe the finish."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_by_string: bool = False
    error: str | None = None


class OutputProcessor:
    """Turns one choice's events into deltas ``{"reasoning_content"}``, ``{"content"}`` or ``{"tool_calls"}``.

    ``prompt`` is the rendered prompt (it tells whether thinking is already open). Tool calls are parsed only
    when the request has tools, ``tool_choice`` is not ``none`` and the model has a dialect. Special tokens
    give no text unless ``skip_special_tokens`` is false, as in vLLM and SGLang; then
    ``spaces_between_special_tokens`` sets them apart with a space. The reasoning and tool-call markers always
    stay. With ``reasoning_in_content`` (``engine.reasoning_in_content``, and every legacy completion) the text
    passes through unsplit, though reasoning tokens are still counted. ``eos_logprobs``: the EOS that ended the
    choice gets a logprob entry (legacy completions, as OpenAI and vLLM report it).
    """

    def __init__(
        self,
        index: int,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        *,
        prompt: str = "",
        dialect: Dialect | None = None,
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        reasoning_in_content: bool = False,
        request_tag: int | str = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        eos_logprobs: bool = False,
    ) -> None:
        self.index = index
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.eos_logprobs = eos_logprobs
        start, end = (dialect.think_start, dialect.think_end) if dialect else THINK_TAGS
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            stop=params.stop,
            **_special_ids(
                tokenizer, dialect, start, end, skip_special_tokens, spaces_between_special_tokens, params
            ),
        )
        parse_tools = dialect is not None and bool(tools) and tool_choice != "none"
        self.calls_stream = dialect.stream(tool_specs(tools), request_tag) if parse_tools else None
        # the reasoning split: "maybe_start" until the output shows whether it opens a thinking block itself
        self._start_tag, self._end_tag = start, end
        self._reasoning_in_content = reasoning_in_content
        self._split_state = "reasoning" if prompt_opens_thinking(prompt, start) else "maybe_start"
        self._split_held = ""
        self._strip_lead = False  # drop the newlines right after <think> / </think>
        self.reasoning_tokens = 0
        self.reasoning = ""
        self.content = ""
        # serving totals
        self.completion_tokens = 0
        self.cumulative_logprob = 0.0  # of the generated tokens, when sampled with logprobs (ranks best_of)
        self.cached_tokens = 0
        self.timing: SeqTiming | None = None  # as of the latest event
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[dict[str, Any]] = []
        self._held_entries: list[dict[str, Any]] = []  # of tokens the tool-call parser holds
        self._entries = LogprobEntries(tokenizer) if params.logprobs else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # --- per event ----------------------------------------------------------------------------------------------

    def feed(self, ev: SeqEvent) -> Delta:
        delta = Delta()
        if self.finished:
            return delta
        self.cached_tokens = ev.cached_tokens
        self.timing = ev.timing or self.timing
        for token, sample in zip(ev.tokens, ev.samples, strict=True):
            hidden = self._split_state == "reasoning" and not self._reasoning_in_content
            parts = self._route(self.detokenizer.push(token))
            delta.parts += parts
            self.completion_tokens += 1
            if sample.logprob is not None:
                self.cumulative_logprob += sample.logprob
            stopped = self.detokenizer.stopped
            # logprobs describe generated tokens but a fully suppressed stop token and, in a chat, EOS; reasoning
            # ones are marked and go to ``logprobs.reasoning_content``, as reasoning tokens go to
            # ``reasoning_content`` whether the template hides them or not
            eos_entry = self.eos_logprobs or token not in self.eos_token_ids
            if self._entries is not None and eos_entry and (stopped is None or parts):
                entry = self._entries.entry(
                    token, sample.logprob, sample.top_logprobs, self.detokenizer.last_piece
                )
                if hidden:
                    delta.logprobs.append({**entry, REASONING: True})
                else:
                    self._place_entry(entry, parts, delta)
            if stopped is not None:
                self.completion_tokens = stopped.token_index + 1  # up to the token that completed the match
                delta.stopped_by_string = True
                self._finish(delta, "stop")
                return delta
        if ev.error is not None:
            delta.error = self.error = ev.error
            self._finish(delta, "error")
        elif ev.retired is not None:
            self._finish(delta, self._finish_reason(ev.retired))
        else:
            self.logprobs.extend(delta.logprobs)
        return delta

    def _finish_reason(self, retired: RetireReason) -> str:
        """OpenAI's ``finish_reason``: a choice that EOS ended after a tool call reports ``tool_calls``."""
        if retired in (RetireReason.LENGTH, RetireReason.POOL_EXHAUSTED):
            return "length"
        return "tool_calls" if retired is RetireReason.EOS and self.tool_calls else "stop"

    def _finish(self, delta: Delta, reason: str) -> None:
        """End of the choice (EOS, length, stop string, cancel or error): flush everything held back."""
        tail = self._route(self.detokenizer.finish(), is_token=False)  # held-back text, not another id
        tail += self._route_split(*self._split_finish())
        if self.calls_stream is not None:
            tail += self._collect(self.calls_stream.finish())
        flushed = (
            self.detokenizer.last_piece
        )  # an unfinished character ends the text as U+FFFD: the last entry's
        entries = delta.logprobs or self.logprobs or self._held_entries
        if flushed and entries:
            entries[-1]["token"] += flushed
        delta.parts += tail
        if not any("tool_calls" in p for p in tail):  # a cut-off or malformed block flushes as content
            delta.logprobs += self._held_entries
        self._held_entries = []
        delta.finish_reason = self.finish_reason = reason
        self.logprobs.extend(delta.logprobs)

    def _place_entry(self, entry: dict[str, Any], parts: list[dict[str, Any]], delta: Delta) -> None:
        if any("tool_calls" in p for p in parts):  # the held block parsed as calls: its tokens were syntax
            self._held_entries = []
        elif any("content" in p for p in parts):
            delta.logprobs += self._held_entries + [entry]
            self._held_entries = []
        elif self.calls_stream is not None and self.calls_stream.holding:
            self._held_entries.append(entry)
        else:
            delta.logprobs.append(entry)

    # --- text routing: reasoning split, then tool calls ---------------------------------------------------------

    def _route(self, text: str, is_token: bool = True) -> list[dict[str, Any]]:
        if is_token and self._split_state == "reasoning":
            self.reasoning_tokens += 1  # up to and including the token that completes the end tag
        reasoning, content = self._split(text)
        if self._reasoning_in_content:
            return self._route_split("", text)
        return self._route_split(reasoning, content)

    def _route_split(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reasoning:
            self.reasoning += reasoning
            out.append({"reasoning_content": reasoning})
        if content:
            if self.calls_stream is None:
                self.content += content
                out.append({"content": content})
            else:
                out += self._collect(self.calls_stream.push(content))
        return out

    def _collect(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for d in deltas:
            self.content += d.get("content", "")
        return deltas

    def _split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of ``text``: everything before the end tag is reasoning. A tail that could be the
        start of a tag is held back."""
        buf = self._split_held + text
        reasoning, content = [], []
        while buf:
            if self._split_state == "maybe_start":
                stripped = buf.lstrip()
                if stripped.startswith(self._start_tag):
                    buf = stripped[len(self._start_tag) :]
                    self._split_state, self._strip_lead = "reasoning", True
                    continue
                if self._start_tag.startswith(stripped):
                    break  # could still become <think>
                self._split_state = "content"
                continue
            if self._strip_lead:  # the newlines a template or model puts right after a tag are layout
                buf = buf.lstrip("\n")
                if not buf:
                    break
                self._strip_lead = False
            if self._split_state == "reasoning":
                at = buf.find(self._end_tag)
                if at < 0:
                    keep = held_prefix_length(buf, (self._end_tag,))
                    reasoning.append(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep :]
                    break
                reasoning.append(buf[:at])
                buf = buf[at + len(self._end_tag) :]
                self._split_state, self._strip_lead = "content", True
                continue
            content.append(buf)
            buf = ""
        self._split_held = buf
        return "".join(reasoning), "".join(content)

    def _split_finish(self) -> tuple[str, str]:
        held, self._split_held = self._split_held, ""
        if self._reasoning_in_content or not held:
            return "", ""
        return (held, "") if self._split_state == "reasoning" else ("", held)

    # --- results ------------------------------------------------------------------------------------------------

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.calls_stream.calls) if self.calls_stream is not None else []

    def message(self) -> dict[str, Any]:
        """The one-shot ``choices[i].message`` (after the choice finished)."""
        calls = self.tool_calls
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if self.content or not calls else None,
        }
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if calls:
            msg["tool_calls"] = [c.as_openai() for c in calls]
        msg["refusal"] = None
        return msg


def _special_ids(
    tokenizer: Any,
    dialect: Dialect | None,
    start: str,
    end: str,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
    params: SamplingParams,
) -> dict[str, Iterable[int]]:
    """The detokenizer's ``skip_ids`` and ``spaced_ids``. The EOS that ends a choice gives no text (vLLM's rule);
    with ``skip_special_tokens`` false, BOS and EOS are text like any special token, EOS only where it does not
    end the choice (the request ignores EOS). Special tokens the reasoning split and the tool parser read stay
    text whatever the request says."""
    eos_is_text = params.ignore_eos and not skip_special_tokens
    hidden = set() if eos_is_text else set(tokenizer.eos_token_ids)
    if skip_special_tokens and tokenizer.bos_token_id is not None:
        hidden.add(tokenizer.bos_token_id)
    markers = {start, end, *(m for pair in (dialect.markers if dialect else ()) for m in pair)}
    kept = {tokenizer.token_to_id(m) for m in markers}
    specials = tokenizer.special_ids - kept
    if skip_special_tokens:
        hidden |= specials
    spaced = specials - hidden if spaces_between_special_tokens else frozenset()
    return {"skip_ids": hidden, "spaced_ids": spaced}
