"""A Responses request -> the chat-completions request the chat route already serves.

Input items become chat messages: ``message`` items keep their role and text parts, ``reasoning`` items
become the following assistant turn's ``reasoning_content``, ``function_call`` items that assistant turn's
``tool_calls`` and ``function_call_output`` items ``tool`` messages. Flat function tools get the chat route's
nested shape, ``text.format`` becomes ``response_format`` and ``reasoning.effort`` ``reasoning_effort``; the
chat route's own validation then checks the whole request. Errors name the Responses parameter.
"""

from __future__ import annotations

from typing import Any

from dgpp.serve.errors import APIError, invalid, unsupported
from dgpp.serve.responses_protocol import CHAT_EXTENSIONS, REFUSED_WHEN_SET, ResponsesRequest

# ``include`` values a client may send; none asks for anything this server leaves out but the logprobs one.
KNOWN_INCLUDES = (
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "message.input_image.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
)
INCLUDE_LOGPROBS = "message.output_text.logprobs"
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file")
# chat parameters -> the Responses parameter an error names (``prompt``: what
# serve/generation.generation_request calls the prompt of a request that is not a chat completion)
CHAT_TO_RESPONSES = {
    "messages": "input",
    "prompt": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "top_logprobs",
}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


def check_request(req: ResponsesRequest) -> None:
    """What the Structs cannot say: fields refused when set, include values, truncation."""
    for name in REFUSED_WHEN_SET:
        if getattr(req, name) not in (None, False):
            raise unsupported(name, "is not supported by this server")
    if req.truncation == "auto":
        raise unsupported(
            "truncation", "'auto' is not supported (a prompt past the context is refused instead)"
        )
    for i, name in enumerate(req.include or []):
        if name not in KNOWN_INCLUDES:
            raise invalid(f"include[{i}] {name!r} is not one of {', '.join(KNOWN_INCLUDES)}", f"include[{i}]")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options requires stream: true", "stream_options")
    if not req.input and req.previous_response_id is None:
        raise invalid("input is required (a string or a non-empty list of items)", "input")


def chat_messages(items: list[Any], first_input: int = 0, *, model: str) -> list[dict[str, Any]]:
    """Chat messages of ``items``; items from ``first_input`` on are the request's own (errors name them, and a
    media part's refusal names the served ``model``)."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn that reasoning, text and calls join
    for i, item in enumerate(items):
        where = f"input[{i - first_input}]" if i >= first_input else f"previous input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", "input")
            content = _content(item.get("content"), where, model)
            if role != "assistant":
                out.append({"role": role, "content": content})
                turn = None
            elif turn is not None and not turn["content"] and "tool_calls" not in turn:
                turn["content"] = content
            else:
                turn = {"role": "assistant", "content": content}
                out.append(turn)
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if turn is not None and not turn["content"] and "tool_calls" not in turn:
                turn["reasoning_content"] = turn.get("reasoning_content", "") + text
            else:
                turn = {"role": "assistant", "content": "", "reasoning_content": text}
                out.append(turn)
        elif kind in ("function_call", "custom_tool_call"):
            call = _tool_call(item, where)
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            turn.setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"{where}.call_id must be a non-empty string", "input")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _content(item.get("output"), where, model),
                }
            )
            turn = None
        else:
            raise unsupported(
                "input",
                f"item {where} of type {kind!r} is not supported (this server takes message, "
                "reasoning, function_call, custom_tool_call and their output items)",
            )
    return out


def _content(content: Any, where: str, model: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or an array of content parts", "input")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise unsupported(
                "input",
                f"{where}.content[{j}] is a {kind} part; model {model!r} is served for text only here",
            )
        if kind not in TEXT_PARTS:
            raise invalid(f"{where}.content[{j}] must be an input_text or output_text part", "input")
    return content


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The reasoning item's own text, else its summary (an item from another server may carry only that)."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
        ):
            raise invalid(f"{where}.{key} must be an array of {part_type} parts", "input")
        if parts:
            return "\n".join(p["text"] for p in parts)
    return ""


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` or ``custom_tool_call`` item as a chat tool call."""
    custom = item["type"] == "custom_tool_call"
    for key in ("call_id", "name", "input" if custom else "arguments"):
        if not isinstance(item.get(key), str):
            raise invalid(f"{where}.{key} must be a string", "input")
    if custom:
        return {
            "id": item["call_id"],
            "type": "custom",
            "custom": {"name": item["name"], "input": item["input"]},
        }
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function and custom tools in the chat route's nested shape; other types are refused."""
    if tools is None:
        return None
    return [_chat_tool(tool, i) for i, tool in enumerate(tools)]


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type")
    if kind == "function":
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        if isinstance(tool.get("strict"), bool):
            fn["strict"] = tool["strict"]
        return {"type": "function", "function": fn}
    if kind == "custom":
        body = {k: tool[k] for k in ("name", "description") if tool.get(k) is not None}
        fmt = tool.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "grammar":  # flat here, nested in the chat route
            fmt = {"type": "grammar", "grammar": {k: fmt.get(k) for k in ("syntax", "definition")}}
        if fmt is not None:
            body["format"] = fmt
        return {"type": "custom", "custom": body}
    raise unsupported(
        f"tools[{i}].type", f"{kind!r} is not supported (this server calls function and custom tools)"
    )


def chat_tool_choice(choice: Any) -> Any:
    """Responses' flat ``tool_choice`` objects in the chat route's nested shape."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": kind, kind: {"name": choice["name"]}}
    if kind == "allowed_tools":
        return {
            "type": "allowed_tools",
            "allowed_tools": {"mode": choice.get("mode", "auto"), "tools": choice.get("tools")},
        }
    raise unsupported(
        "tool_choice",
        'must be auto, none, required, {"type": "function" or "custom", "name": ...} or allowed_tools',
    )


def chat_response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        inner = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": inner}
    return fmt  # json_object, or a type the chat route's check refuses by name


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions request (plain JSON data) that serves ``req`` on ``messages``."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    want_logprobs = req.top_logprobs is not None or INCLUDE_LOGPROBS in (req.include or [])
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "logprobs": want_logprobs or None,
        "top_logprobs": req.top_logprobs if want_logprobs else None,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": chat_response_format(req.text.format if req.text else None),
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "service_tier": req.service_tier,
    }
    body.update({k: getattr(req, k) for k in CHAT_EXTENSIONS})
    return {k: v for k, v in body.items() if v is not None}


def renamed(err: APIError) -> APIError:
    """``err`` (raised on the chat request) naming the Responses parameter instead of the chat one."""
    if err.param is None:
        return err
    head, sep, rest = err.param.partition(".")
    base = head.split("[")[0]
    if base in CHAT_TO_RESPONSES:
        err.param = (
            CHAT_TO_RESPONSES[base]
            if base in ("messages", "prompt")
            else CHAT_TO_RESPONSES[base] + sep + rest
        )
    return err
