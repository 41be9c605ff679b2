"""Split streamed output into reasoning (before ``</think>``) and content, and count reasoning tokens."""

from __future__ import annotations

from dataclasses import dataclass

from dgpp.text.detokenizer import held_prefix_length


@dataclass(frozen=True)
class Split:
    """What one push adds to ``reasoning_content`` and to ``content``."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Routes one request's text: everything before ``end_tag`` is reasoning, the rest is content.

    A request starts inside reasoning when its prompt opened the thinking block (the generation prompt ends
    with ``start_tag``); otherwise a ``start_tag`` at the very start of the output opens it. A tail that could
    be the start of a tag is held back. ``reasoning_tokens`` counts the tokens pushed while reasoning, up to
    and including the one that completes ``end_tag``. With ``in_content`` the text is passed
    through unchanged (reasoning and ``</think>`` stay in ``content``; ``engine.reasoning_in_content``).
    """

    def __init__(
        self,
        prompt_opens_thinking: bool,
        start_tag: str = "<think>",
        end_tag: str = "</think>",
        in_content: bool = False,
    ) -> None:
        self.start_tag, self.end_tag = start_tag, end_tag
        self.in_content = in_content
        self._state = "reasoning" if prompt_opens_thinking else "maybe_start"
        self._buf = ""
        self._strip_lead = False  # drop the newlines right after <think> / </think>
        self.reasoning_tokens = 0

    @staticmethod
    def prompt_opens_thinking(prompt: str, start_tag: str = "<think>", end_tag: str = "</think>") -> bool:
        """True when the rendered prompt leaves a thinking block open for the model to continue."""
        return prompt.rstrip().endswith(start_tag)

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def push(self, text: str, is_token: bool = True) -> Split:
        """Add the text of one generated token (may be ""); ``is_token=False`` for text released without a
        new token (the detokenizer's final flush), which is routed but not counted."""
        if is_token and self._state == "reasoning":
            self.reasoning_tokens += 1
        if self.in_content:
            self._route(text)  # still tracks state for the token count
            return Split(content=text)
        return self._route(text)

    def finish(self) -> Split:
        out, self._buf = self._buf, ""
        if self.in_content or not out:
            return Split()
        return Split(reasoning=out) if self._state == "reasoning" else Split(content=out)

    def _route(self, text: str) -> Split:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._state == "maybe_start":
                stripped = self._buf.lstrip()
                if stripped.startswith(self.start_tag):
                    self._buf = stripped[len(self.start_tag) :]
                    self._state, self._strip_lead = "reasoning", True
                    continue
                if self.start_tag.startswith(stripped):
                    break  # could still become <think>
                self._state = "content"
                continue
            if self._strip_lead:  # the newlines a template or model puts right after a tag are layout
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._strip_lead = False
            if self._state == "reasoning":
                at = self._buf.find(self.end_tag)
                if at < 0:
                    keep = held_prefix_length(self._buf, (self.end_tag,))
                    reasoning.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                reasoning.append(self._buf[:at])
                self._buf = self._buf[at + len(self.end_tag) :]
                self._state, self._strip_lead = "content", True
                continue
            content.append(self._buf)
            self._buf = ""
        return Split(reasoning="".join(reasoning), content="".join(content))
