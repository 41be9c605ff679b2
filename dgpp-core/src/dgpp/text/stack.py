"""One model's whole text stack, built once at startup: what the serving layer holds per model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from dgpp.text.chat_template import ChatTemplate
from dgpp.text.dialect import Dialect
from dgpp.text.grammar import GrammarContext, GrammarMatcher, build_matcher
from dgpp.text.output import ChoiceOutput
from dgpp.text.reasoning import ReasoningSplitter
from dgpp.text.tokenizer import Tokenizer


@dataclass
class RenderedPrompt:
    """A rendered request: the prompt text and its ids."""

    text: str
    token_ids: list[int]


@dataclass
class TextStack:
    """Tokenizer, chat template, tool dialect and (lazily) the grammar context of one served model."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate
    dialect: Dialect | None = None
    vocab_size: int | None = None
    reasoning_in_content: bool = False
    default_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        family: str,
        hf_config: dict,
        plugin_manager: Any = None,
        *,
        vocab_size: int | None = None,
        reasoning_in_content: bool = False,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> TextStack:
        """Load the checkpoint's tokenizer; the template from it or the family plugin; the plugin's dialect."""
        tokenizer = Tokenizer.from_dir(checkpoint_dir)
        dialect = None
        if plugin_manager is not None:
            dialect = plugin_manager.hook.dgpp_tool_dialect(family=family, hf_config=hf_config)
        template = ChatTemplate.for_checkpoint(
            tokenizer,
            family,
            hf_config,
            plugin_manager,
            effort=dialect.effort if dialect is not None else None,
            default_kwargs=default_chat_template_kwargs,
        )
        return cls(
            tokenizer,
            template,
            dialect,
            vocab_size or hf_config.get("vocab_size"),
            reasoning_in_content,
            dict(default_chat_template_kwargs or {}),
        )

    @cached_property
    def grammar_context(self) -> GrammarContext:
        """Built on first constrained request (about a second for a 100k+ vocabulary)."""
        return GrammarContext(self.tokenizer, self.vocab_size)

    def render(
        self,
        messages: list,
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_effort: str | None = None,
    ) -> RenderedPrompt:
        """Render and tokenize; ``tool_choice: none`` leaves the tools out of the prompt (anchor §2.7)."""
        shown = None if tool_choice == "none" else tools
        text = self.chat_template.render(
            messages, shown, chat_template_kwargs=chat_template_kwargs, reasoning_effort=reasoning_effort
        )
        return RenderedPrompt(text, self.tokenizer.encode(text))

    def matcher(
        self,
        prompt: RenderedPrompt,
        response_format: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
    ) -> GrammarMatcher | None:
        """The request's constraint, or None when it has none (no grammar context is built then)."""
        constrained = (response_format and response_format.get("type", "text") != "text") or (
            tools and tool_choice not in (None, "auto", "none")
        )
        if not constrained:
            return None
        opens = self.dialect is not None and ReasoningSplitter.prompt_opens_thinking(
            prompt.text, self.dialect.think_start, self.dialect.think_end
        )
        return build_matcher(
            self.grammar_context,
            response_format=response_format,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            dialect=self.dialect,
            prompt_opens_thinking=opens,
        )

    def choice_output(
        self,
        prompt: RenderedPrompt,
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        stop: Iterable[str] = (),
        request_tag: int | str = 0,
    ) -> ChoiceOutput:
        return ChoiceOutput(
            self.tokenizer,
            prompt=prompt.text,
            dialect=self.dialect,
            tools=tools,
            tool_choice=tool_choice,
            stop=stop,
            reasoning_in_content=self.reasoning_in_content,
            request_tag=request_tag,
        )

    def model_info(self) -> dict[str, Any]:
        """The text-stack part of the ``/v1/models`` object (anchor §2.10)."""
        return {
            "tools": {"available": self.dialect is not None, "constrained": self.dialect is not None},
            "response_format": {"json_object": True, "json_schema": True},
            "reasoning": {
                "in_content": self.reasoning_in_content,
                "effort_mapping": self.chat_template.effort_mapping(),
            },
            "default_chat_template_kwargs": dict(self.default_kwargs),
        }
