"""Render a conversation into the prompt text, exactly as HF transformers' ``apply_chat_template`` would.

The template comes from the checkpoint (``tokenizer_config.json``'s ``chat_template``, a string or a list of
named templates, or ``chat_template.jinja``), else from the family plugin's ``dgpp_chat_template`` hook.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jinja2

from dgpp.text.effort import SWITCH_ONLY, EffortMapping
from dgpp.text.errors import TemplateError
from dgpp.text.jinja_env import compile_template
from dgpp.text.messages import prepare_messages
from dgpp.text.tools import template_tools, tool_specs

# Names every render passes itself; a caller's chat_template_kwargs may not set them.
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# A template iterates tool-call arguments (HF's dict convention) rather than concatenating a JSON string.
_ITERATES_ARGUMENTS = re.compile(
    r"arguments\s*(\|\s*items|\|\s*tojson|\.items\(\)|\s+is\s+mapping|\s+is\s+string)"
)


class ChatTemplate:
    """A compiled chat template plus what it needs to render: the tokenizer's special tokens, the family's
    reasoning-effort mapping, and deployment default kwargs (e.g. ``enable_thinking``).

    ``render`` raises ``TemplateError`` (param ``messages``, or the kwarg at fault) for anything the
    template refuses; the API turns it into a 400.
    """

    def __init__(
        self,
        source: str | list[dict],
        special_tokens: Mapping[str, str] | None = None,
        effort: EffortMapping | None = None,
        default_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.named = self._named_sources(source)
        self.special_tokens = dict(special_tokens or {})
        self.effort = effort or SWITCH_ONLY
        self.default_kwargs = dict(default_kwargs or {})
        self._compiled: dict[str, tuple[jinja2.Template, frozenset[str]]] = {}
        for name, text in self.named.items():
            try:
                self._compiled[name] = compile_template(text)
            except jinja2.TemplateSyntaxError as exc:
                raise TemplateError(
                    f"chat template {name!r} does not compile: {exc} (line {exc.lineno})"
                ) from exc

    @staticmethod
    def _named_sources(source: str | list[dict]) -> dict[str, str]:
        if isinstance(source, str):
            return {"default": source}
        named = {
            t["name"]: t["template"]
            for t in source
            if isinstance(t, dict) and "name" in t and "template" in t
        }
        if not named:
            raise TemplateError("chat_template list holds no {name, template} entries")
        return named

    # --- construction from a checkpoint ----------------------------------------------------------------------------

    @classmethod
    def for_checkpoint(
        cls,
        tokenizer: Any,
        family: str | None = None,
        hf_config: dict | None = None,
        plugin_manager: Any = None,
        effort: EffortMapping | None = None,
        default_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatTemplate:
        """The checkpoint's own template, else the family plugin's fallback; TemplateError if neither exists."""
        source = tokenizer.chat_template
        if source is None and plugin_manager is not None and family is not None:
            source = plugin_manager.hook.dgpp_chat_template(family=family, hf_config=hf_config or {})
        if source is None:
            raise TemplateError(
                f"{tokenizer.source} has no chat template (tokenizer_config.json chat_template, chat_template.jinja) "
                f"and no plugin provides one for family {family!r}"
            )
        return cls(source, tokenizer.special_tokens_map, effort, default_kwargs)

    # --- queries -----------------------------------------------------------------------------------------------

    def source(self, has_tools: bool = False) -> str:
        """HF's choice: the ``tool_use`` template when tools are given and it exists, else ``default``."""
        if has_tools and "tool_use" in self.named:
            return self.named["tool_use"]
        if "default" in self.named:
            return self.named["default"]
        if len(self.named) == 1:
            return next(iter(self.named.values()))
        raise TemplateError(
            f"chat template list has no 'default' entry (has {', '.join(sorted(self.named))})"
        )

    def accepted_kwargs(self, has_tools: bool = False) -> frozenset[str]:
        """Variables the template reads that a caller may set through ``chat_template_kwargs``."""
        return self._compiled_for(has_tools)[1] - RESERVED

    def effort_mapping(self) -> dict[str, dict[str, Any]]:
        return self.effort.describe(self.accepted_kwargs())

    def _compiled_for(self, has_tools: bool) -> tuple[jinja2.Template, frozenset[str]]:
        src = self.source(has_tools)
        name = next(n for n, t in self.named.items() if t == src)
        return self._compiled[name]

    # --- rendering ---------------------------------------------------------------------------------------------

    def render(
        self,
        messages: list,
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_effort: str | None = None,
        documents: list[dict] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (OpenAI shape) and ``tools`` (omit them for ``tool_choice: none``)."""
        specs = tool_specs(tools)
        template, names = self._compiled_for(bool(specs))
        accepted = names - RESERVED
        explicit = dict(chat_template_kwargs or {})
        for key in explicit:
            if key in RESERVED or key not in accepted:
                raise TemplateError(
                    f"chat_template_kwargs.{key} is not a variable of this chat template "
                    f"(accepted: {', '.join(sorted(accepted - set(self.special_tokens))) or 'none'})",
                    f"chat_template_kwargs.{key}",
                )
        kwargs: dict[str, Any] = {**self.special_tokens, **self.default_kwargs}
        kwargs.update(self.effort.kwargs(reasoning_effort, accepted, explicit))
        kwargs.update(explicit)
        prepared = prepare_messages(
            messages, arguments_as_dict=bool(_ITERATES_ARGUMENTS.search(self.source(bool(specs))))
        )
        try:
            text = template.render(
                messages=prepared,
                tools=template_tools(specs),
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed on these messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc
        if not text:
            raise TemplateError("chat template rendered an empty prompt for these messages")
        return text
