"""OpenAI chat messages -> the plain dicts chat templates read (HF conventions).

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
from typing import Any

from dgpp.text.errors import TemplateError

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
