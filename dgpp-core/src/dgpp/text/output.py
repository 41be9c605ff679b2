"""One choice's generated ids -> OpenAI deltas and the final assistant message.

The chain per token is: ``IncrementalDetokenizer`` (whole characters, stop strings) -> ``ReasoningSplitter``
(``reasoning_content`` before ``</think>``) -> the family ``Dialect``'s stream parser over the content
(tool calls as two deltas each). The serving layer feeds sampled ids and forwards the deltas.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dgpp.text.detokenizer import IncrementalDetokenizer, StopMatch
from dgpp.text.dialect import Dialect, ToolCall
from dgpp.text.reasoning import ReasoningSplitter
from dgpp.text.tokenizer import Tokenizer
from dgpp.text.tools import tool_specs


class ChoiceOutput:
    """Turns one choice's ids into deltas: ``{"reasoning_content"}``, ``{"content"}`` or ``{"tool_calls"}``.

    ``prompt`` is the rendered prompt (it tells whether thinking is already open). Tool calls are parsed
    only when the request has tools and ``tool_choice`` is not ``none`` and the model has a dialect.
    Special tokens (``<|im_end|>``, ``<|endoftext|>``...) give no text unless ``skip_special_tokens`` is
    false, as in vLLM and SGLang; then ``spaces_between_special_tokens`` sets them apart from the text
    around them with a space. The reasoning and tool-call markers always stay.
    After a stop-string match (``stopped``) further ids are ignored; the caller ends the choice.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prompt: str = "",
        dialect: Dialect | None = None,
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        stop: Iterable[str] = (),
        reasoning_in_content: bool = False,
        request_tag: int | str = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        eos_is_text: bool = False,
    ) -> None:
        start, end = (dialect.think_start, dialect.think_end) if dialect else ("<think>", "</think>")
        # the EOS that ends a choice gives no text (vLLM's rule); with ``skip_special_tokens`` false, BOS and EOS
        # are text like any special token (SmolLM2's are <|im_start|> / <|im_end|>), EOS only where it does
        # not end the choice (``eos_is_text``: the request ignores EOS)
        hidden = set() if eos_is_text and not skip_special_tokens else set(tokenizer.eos_token_ids)
        if skip_special_tokens and tokenizer.bos_token_id is not None:
            hidden.add(tokenizer.bos_token_id)
        # special tokens the reasoning split and the tool parser read stay text whatever the request says
        markers = {start, end, *(m for pair in (dialect.markers if dialect else ()) for m in pair)}
        kept = {tokenizer.token_to_id(m) for m in markers}
        specials = tokenizer.special_ids - kept
        if skip_special_tokens:
            hidden |= specials
        spaced = specials - hidden if spaces_between_special_tokens else frozenset()
        self.detokenizer = IncrementalDetokenizer(tokenizer, stop=stop, skip_ids=hidden, spaced_ids=spaced)
        self.splitter = ReasoningSplitter(
            ReasoningSplitter.prompt_opens_thinking(prompt, start, end),
            start,
            end,
            in_content=reasoning_in_content,
        )
        specs = tool_specs(tools)
        parse_tools = dialect is not None and bool(specs) and tool_choice != "none"
        self.calls_stream = dialect.stream(specs, request_tag) if parse_tools else None
        self.reasoning = ""
        self.content = ""

    # --- per token ----------------------------------------------------------------------------------------------

    def push(self, token_id: int) -> list[dict[str, Any]]:
        if self.detokenizer.stopped is not None:
            return []
        return self._route(self.detokenizer.push(token_id))

    def finish(self) -> list[dict[str, Any]]:
        """End of the choice (EOS, length, stop string or cancel): flush everything held back."""
        out = self._route(self.detokenizer.finish(), is_token=False)  # held-back text, not another id
        tail = self.splitter.finish()
        out += self._route_split(tail.reasoning, tail.content)
        if self.calls_stream is not None:
            out += self._collect(self.calls_stream.finish())
        return out

    def _route(self, text: str, is_token: bool = True) -> list[dict[str, Any]]:
        part = self.splitter.push(text, is_token)
        return self._route_split(part.reasoning, part.content)

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

    # --- results ------------------------------------------------------------------------------------------------

    @property
    def stopped(self) -> StopMatch | None:
        return self.detokenizer.stopped

    @property
    def last_piece(self) -> str:
        """The text the last pushed id added to the output (its logprob entry's token)."""
        return self.detokenizer.last_piece

    @property
    def holding_call_text(self) -> bool:
        """True while the tool-call parser holds text that may yet turn out to be a call."""
        return self.calls_stream is not None and self.calls_stream.holding

    @property
    def completion_tokens(self) -> int:
        """Ids counted for usage: after a stop-string match, up to the id that completed it."""
        if self.stopped is not None:
            return self.stopped.token_index + 1
        return self.detokenizer.num_tokens

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.reasoning_tokens

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.calls_stream.calls) if self.calls_stream is not None else []

    def finish_reason(self, reason: str) -> str:
        """``stop`` becomes ``tool_calls`` when the choice made at least one call."""
        return "tool_calls" if reason == "stop" and self.tool_calls else reason

    def message(self) -> dict[str, Any]:
        """The one-shot ``choices[i].message`` (call after ``finish``)."""
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
