"""Request body -> a typed request; every failure is one 400 naming the field. The request's sampling and
generation limits are decided in ``serve/generation.py``.

``response_format`` is checked as OpenAI checks it: a missing or misspelt ``type``, an unknown key, or a
``json_schema`` without its ``name`` is a 400 naming the field, never a silent fall back to plain text. Whether
the schema itself can be enforced is the grammar's call (``dgpp.text.grammar``). Media parts other than
``image_url`` are refused by position; ``image_url`` parts are refused the same way by a text-only model
(``refuse_image_parts``) and read by a model with a vision encoder (``dgpp.serve.images``)."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec

from dgpp.serve.errors import APIError, invalid, unsupported
from dgpp.serve.protocol import (
    COMPLETION_REJECTED,
    IGNORED_EXTENSIONS,
    REJECTED,
    REJECTED_WHEN_SET,
    ChatCompletionRequest,
    CompletionRequest,
)

T = TypeVar("T", ChatCompletionRequest, CompletionRequest)
S = TypeVar("S", bound=msgspec.Struct)
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a tool's or a json_schema's name
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_KEYS = ("name", "description", "schema", "strict")
IMAGE_PART = "image_url"


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise _DuplicateKey(k)
        seen[k] = v
    return seen


# what to use instead, for fields other OpenAI-compatible servers take and this one does not
_INSTEAD = {
    "guided_json": 'use response_format {"type": "json_schema"}',
    "guided_regex": "use response_format json_schema with a string schema and a pattern",
    "guided_choice": "use response_format json_schema with an enum",
    "guided_grammar": "use response_format json_schema",
    "min_tokens": "not implemented here",
}


def check_content_type(scope: dict[str, Any]) -> None:
    """415 for a body declared as anything but JSON (a form post, text/plain); no Content-Type is read as JSON."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            if media != b"application/json" and not media.endswith(b"+json"):
                raise APIError(
                    415,
                    f"Content-Type {value.decode('latin-1')!r} is not JSON; send the body as "
                    "application/json",
                    "unsupported_media_type",
                    None,
                )
            return


def _known_fields(raw: dict[str, Any], kind: type[T], allow_unknown: bool) -> dict[str, Any]:
    """``raw`` when every field is one this route takes; else a 400 naming the others (the client asked for
    something this server would not do), or, with ``http.allow_unknown_fields``, ``raw`` without them."""
    known = set(kind.__struct_fields__) | set(IGNORED_EXTENSIONS)
    if kind is ChatCompletionRequest:
        known |= set(REJECTED_WHEN_SET)  # refused above unless null
    unknown = sorted(k for k in raw if k not in known)
    if not unknown:
        return raw
    if allow_unknown:
        return {k: v for k, v in raw.items() if k in known}
    hints = "".join(f"; {k}: {_INSTEAD[k]}" for k in unknown if k in _INSTEAD)
    names = ", ".join(repr(k) for k in unknown)
    raise APIError(
        400,
        f"unknown field{'s' if len(unknown) > 1 else ''} {names}: not part of this route's request "
        f"(refused rather than ignored{hints}; the server's http.allow_unknown_fields ignores them)",
        "unsupported_parameter",
        unknown[0],
    )


def parse_body(body: bytes, kind: type[T], allow_unknown: bool = False) -> tuple[T, dict[str, Any]]:
    raw = decode_json(body)
    rejected = REJECTED if kind is ChatCompletionRequest else COMPLETION_REJECTED
    for name in rejected:
        if name in raw:
            raise unsupported(name)
    if kind is ChatCompletionRequest:
        for name in REJECTED_WHEN_SET:
            if raw.get(name) is not None:
                raise unsupported(name)
    raw = _known_fields(raw, kind, allow_unknown)
    req = convert(raw, kind)
    _check(req)
    return req, raw


def decode_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object: duplicate keys, bad JSON and lone surrogates are 400s."""
    try:
        raw = json.loads(body, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise invalid(f"duplicate key {e.args[0]!r} in the request body", e.args[0]) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}", None) from None
    except RecursionError:  # the stdlib decoder recurses per nesting level; a client's [[[[... is not a 500
        raise invalid("the request body nests JSON arrays/objects too deeply", None) from None
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object", None)
    try:  # JSON may escape lone UTF-16 surrogates ("\\ud800"), which no tokenizer can take
        json.dumps(raw, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(
            "the request holds an unpaired UTF-16 surrogate escape (not valid Unicode text)", None
        ) from None
    return raw


def convert(raw: dict[str, Any], kind: type[S]) -> S:
    """``raw`` as a ``kind`` Struct; a type, range, unknown or missing field is a 400 naming it."""
    try:
        return msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH.search(text)
        param = m.group(1) if m else None
        if param and "[" in param:
            param = param.split("[")[0] or param
        if text.startswith("Object contains unknown field"):
            field = text.split("`")[1]
            raise unsupported(f"{param}.{field}" if param else field) from None
        if text.startswith("Object missing required field"):
            field = text.split("`")[1]
            param = f"{param}.{field}" if param else field
            raise invalid(f"{field} is required", param) from None
        raise invalid(f"{param or 'request'}: {text.split(' - at ')[0]}", param) from None


def _check(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options requires stream: true", "stream_options")
    if req.sse_ping_interval is not None and not req.stream:
        raise invalid("sse_ping_interval requires stream: true", "sse_ping_interval")
    if req.sse_ping_interval == 0:
        raise invalid("sse_ping_interval must be positive seconds or -1 (off)", "sse_ping_interval")
    if isinstance(req, CompletionRequest):
        _check_legacy(req)
    if isinstance(req, ChatCompletionRequest):
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise invalid("send one of max_tokens and max_completion_tokens, not both", "max_tokens")
        if req.top_logprobs and not req.logprobs:
            raise invalid("top_logprobs requires logprobs: true", "top_logprobs")
        if req.store:
            raise invalid("store: true is not supported (nothing is stored)", "store")
        if req.service_tier not in (None, "auto", "default"):
            raise invalid(f"service_tier {req.service_tier!r} is not offered (auto, default)", "service_tier")
        if req.modalities is not None and req.modalities != ["text"]:
            raise invalid('only modalities ["text"] is supported', "modalities")
        check_response_format(req.response_format)
        _check_tools(req)
        _check_media(req.messages, req.model)


def _check_legacy(req: CompletionRequest) -> None:
    if req.suffix:
        raise unsupported("suffix", "is not supported (no fill-in-the-middle prompt format is known here)")
    n = req.n or 1
    if req.best_of is not None and req.best_of < n:
        raise invalid(f"best_of ({req.best_of}) must be greater than or equal to n ({n})", "best_of")
    if req.best_of is not None and req.best_of > n and req.stream:
        raise invalid(
            "best_of greater than n cannot be streamed: the best choices are known only at the end", "best_of"
        )
    if req.max_tokens == 0 and req.stream:
        raise invalid("max_tokens 0 (score the prompt only) needs stream: false", "max_tokens")


def _check_tools(req: ChatCompletionRequest) -> None:
    """Tool names ``[A-Za-z0-9_-]{1,64}``, unique; a forcing ``tool_choice`` needs tools."""
    seen: set[str] = set()
    for i, tool in enumerate(req.tools or []):
        inner = tool.get(tool.get("type", "function"))
        name = (inner if isinstance(inner, dict) else tool).get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid(f"tools[{i}] name {name!r} must match [A-Za-z0-9_-]{{1,64}}", f"tools[{i}]")
        if name in seen:
            raise invalid(f"tools[{i}] repeats the tool name {name!r}", f"tools[{i}]")
        params = inner.get("parameters") if isinstance(inner, dict) else None
        if params is not None and not isinstance(params, dict):  # templates and grammars read it as a schema
            raise invalid(f"tools[{i}].function.parameters must be a JSON Schema object", f"tools[{i}]")
        seen.add(name)
    if req.tool_choice not in (None, "auto", "none") and not req.tools:
        raise invalid("tool_choice other than auto/none needs tools", "tool_choice")
    if isinstance(req.tool_choice, str) and req.tool_choice not in ("auto", "none", "required"):
        raise invalid(
            f"tool_choice {req.tool_choice!r} is not auto, none, required or an object", "tool_choice"
        )


def _check_media(messages: list[Any], model: str) -> None:
    """Audio and file parts (and the Responses API's ``input_image`` in a chat message) are refused by position
    instead of dropped, naming the model; ``image_url`` parts are the backend's to take or refuse
    (``dgpp.serve.images``)."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_audio", "file", "input_file"):
                raise unsupported(
                    f"messages[{i}].content[{j}]",
                    f"is a {kind} part; model {model!r} does not take {kind} parts",
                )


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(
            404,
            f"model {requested!r} is not served here (this server serves {served!r})",
            "model_not_found",
            "model",
        )


def check_response_format(fmt: dict[str, Any] | None) -> None:
    if fmt is None:
        return
    if "type" not in fmt:
        raise invalid(
            f"response_format.type is required (one of {', '.join(RESPONSE_FORMAT_TYPES)})",
            "response_format.type",
        )
    for key in fmt:
        if key not in ("type", "json_schema"):
            raise unsupported(f"response_format.{key}", "is not a response_format field (type, json_schema)")
    kind = fmt["type"]
    if kind not in RESPONSE_FORMAT_TYPES:
        raise invalid(
            f"response_format.type {kind!r} is not one of {', '.join(RESPONSE_FORMAT_TYPES)}",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    if kind != "json_schema":
        if spec is not None:
            raise invalid(
                f"response_format.json_schema needs type json_schema, not {kind!r}",
                "response_format.json_schema",
            )
        return
    if not isinstance(spec, dict):
        raise invalid(
            "response_format.json_schema is required with type json_schema and must be an object",
            "response_format.json_schema",
        )
    for key in spec:
        if key not in _SCHEMA_KEYS:
            raise unsupported(
                f"response_format.json_schema.{key}",
                f"is not a json_schema field ({', '.join(_SCHEMA_KEYS)})",
            )
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(
            "response_format.json_schema.name is required and must match [A-Za-z0-9_-]{1,64}",
            "response_format.json_schema.name",
        )
    if "schema" in spec and not isinstance(spec["schema"], dict):
        raise invalid(
            "response_format.json_schema.schema must be a JSON Schema object",
            "response_format.json_schema.schema",
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid(
            "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"
        )


def image_parts(messages: list[Any]) -> list[tuple[int, int, dict]]:
    """``(message index, part index, part)`` of every ``image_url`` part, in order."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            found += [
                (i, j, p)
                for j, p in enumerate(content)
                if isinstance(p, dict) and p.get("type") == IMAGE_PART
            ]
    return found


def refuse_image_parts(messages: list[Any], model_id: str) -> None:
    """A text-only model: 400 naming the model and the first image part."""
    parts = image_parts(messages)
    if parts:
        i, j, _ = parts[0]
        raise invalid(
            f"model {model_id!r} takes text only (it has no vision encoder); messages[{i}].content[{j}] is an "
            "image_url part",
            f"messages[{i}].content[{j}]",
            "unsupported_parameter",
        )
