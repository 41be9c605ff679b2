"""Render a conversation into the prompt text, exactly as HF transformers' ``apply_chat_template`` would.

The template comes from the checkpoint (``tokenizer_config.json``'s ``chat_template``, a string or a list of
named templates, or ``chat_template.jinja``), else from the family plugin's ``dgpp_chat_template`` hook.

First the OpenAI chat messages become the plain dicts chat templates read (``prepare_messages``, HF
conventions):

- ``developer`` becomes ``system``;
- text parts (``text`` / ``input_text`` / ``output_text`` / ``refusal``) are joined in order with "\\n";
  an image's placeholder text (``image_text`` parts, written by the server for models that read images) joins
  its neighbours without a separator; other media parts keep the parts list;
- Anthropic-style ``thinking`` parts fold into ``reasoning_content``; ``redacted_thinking`` payloads are dropped;
  so do the ``thinking_blocks`` LiteLLM forwards beside the content, and a ``reasoning`` string (vLLM's newer
  name for the field), when the message has no ``reasoning_content`` of its own;
- assistant tool calls keep OpenAI's shape; ``arguments`` is parsed into a dict for templates that iterate it
  (HF's convention) and left a JSON string for templates that concatenate it; custom tool calls become a
  function call with one ``input`` argument;
- keys whose value is None are dropped (as HF does), except an assistant turn with tool calls and no content
  gets ``""`` so templates that test ``content is none`` and those that concatenate it render the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import jinja2

from dgpp.text.effort import SWITCH_ONLY, EffortMapping
from dgpp.text.errors import TemplateError
from dgpp.text.jinja_env import compile_template
from dgpp.text.tools import template_tools, tool_specs

TEXT_PARTS = ("text", "input_text", "output_text")
IMAGE_TEXT = "image_text"  # an image's placeholder text, in the place of its image_url part
ROLES = ("system", "developer", "user", "assistant", "tool")


def _fold_parts(parts: list, where: str) -> tuple[Any, str | None]:
    """(content, reasoning) from a list of content parts."""
    pieces: list[tuple[str, bool]] = []  # (text, is an image placeholder)
    reasoning: list[str] = []
    media = False
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise TemplateError(f"{where}.content[{j}] must be an object")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise TemplateError(f"{where}.content[{j}].text must be a string for a {kind} part")
            pieces.append((part["text"], False))
        elif kind == IMAGE_TEXT:
            pieces.append((str(part.get("text", "")), True))
        elif kind == "refusal":
            pieces.append((str(part.get("refusal", "")), False))
        elif kind == "thinking":
            reasoning.append(str(part.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        else:
            media = True
    if media:
        kept = [p for p in parts if p.get("type") not in ("thinking", "redacted_thinking")]
        return kept, ("".join(reasoning) or None)
    # two texts are separated by a newline; an image placeholder touches its neighbours
    joined = "".join(
        ("\n" if j and not image and not pieces[j - 1][1] else "") + text
        for j, (text, image) in enumerate(pieces)
    )
    return joined, ("".join(reasoning) or None)


def _fold_side_reasoning(m: dict, where: str) -> None:
    """LiteLLM's ``thinking_blocks`` and vLLM's ``reasoning`` -> ``reasoning_content`` (which wins if given)."""
    blocks = m.pop("thinking_blocks", None)
    if blocks is not None and not isinstance(blocks, list):
        raise TemplateError(f"{where}.thinking_blocks must be an array of thinking blocks")
    texts = []
    for j, block in enumerate(blocks or []):
        if not isinstance(block, dict) or block.get("type") not in ("thinking", "redacted_thinking"):
            raise TemplateError(f"{where}.thinking_blocks[{j}] must be a thinking or redacted_thinking block")
        if block["type"] == "thinking":
            texts.append(str(block.get("thinking", "")))
    reasoning = m.get("reasoning")  # kept too: a template may read it by this name
    folded = "".join(texts) or (reasoning if isinstance(reasoning, str) else None)
    if folded and "reasoning_content" not in m:
        m["reasoning_content"] = folded


def _tool_call(call: Any, where: str, arguments_as_dict: bool) -> dict:
    if not isinstance(call, dict):
        raise TemplateError(f"{where} must be an object")
    if call.get("type") == "custom":
        body = call.get("custom") or {}
        fn = {
            "name": body.get("name"),
            "arguments": json.dumps({"input": body.get("input", "")}, ensure_ascii=False),
        }
    else:
        if not isinstance(call.get("function"), dict):
            raise TemplateError(f"{where}.function must be an object")
        fn = dict(call["function"])
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise TemplateError(f"{where} needs a tool name (a non-empty string)")
    args = fn.get("arguments", "{}")
    if arguments_as_dict and isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise TemplateError(f"{where}.function.arguments is not valid JSON: {exc}") from exc
    elif not arguments_as_dict and not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    fn["arguments"] = args
    out = {k: v for k, v in call.items() if k not in ("function", "custom") and v is not None}
    out["type"] = "function"
    out["function"] = fn
    return out


def prepare_messages(messages: list, arguments_as_dict: bool = True) -> list[dict]:
    """Normalize a request's messages for rendering (a fresh copy; the caller's list is untouched)."""
    if not isinstance(messages, list):
        raise TemplateError("messages must be an array")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise TemplateError(f"{where} must be an object with a string role")
        m = {k: v for k, v in msg.items() if v is not None}
        if m["role"] == "developer":
            m["role"] = "system"
        if m["role"] not in ROLES:
            raise TemplateError(f"{where}.role {m['role']!r} is not one of {', '.join(ROLES)}")
        if m["role"] in ("user", "tool") and "content" not in m:
            raise TemplateError(f"{where}.content is required for a {m['role']} message")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise TemplateError(f"{where}.tool_call_id is required for a tool message")
        if "content" in m and not isinstance(m["content"], (str, list)):
            raise TemplateError(f"{where}.content must be a string or an array of content parts")
        if isinstance(m.get("content"), list):
            content, reasoning = _fold_parts(m["content"], where)
            m["content"] = content
            if reasoning is not None and "reasoning_content" not in m:
                m["reasoning_content"] = reasoning
        _fold_side_reasoning(m, where)
        if "tool_calls" in m and not isinstance(m["tool_calls"], list):
            raise TemplateError(f"{where}.tool_calls must be an array")
        if m["role"] == "assistant" and m.get("tool_calls"):
            m["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{j}]", arguments_as_dict)
                for j, c in enumerate(m["tool_calls"])
            ]
            m.setdefault("content", "")
        elif "tool_calls" in m and not m["tool_calls"]:
            del m["tool_calls"]  # an empty list would make templates render an empty tool-call block
        out.append(m)
    return out


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
        specs = tool_specs(tools) if tools else []
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
        if reasoning_effort is not None:
            kwargs.update(self.effort.kwargs(reasoning_effort, accepted, explicit))
        kwargs.update(explicit)
        prepared = prepare_messages(
            messages, arguments_as_dict=bool(_ITERATES_ARGUMENTS.search(self.source(bool(specs))))
        )
        try:
            text = template.render(
                messages=prepared,
                tools=template_tools(specs) if specs else None,
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
