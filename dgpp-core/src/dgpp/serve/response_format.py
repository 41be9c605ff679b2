"""``response_format`` checked as OpenAI checks it: a missing or misspelt ``type``, an unknown key, or a
``json_schema`` without its ``name`` is a 400 naming the field, never a silent fall back to plain text.
Whether the schema itself can be enforced is the grammar's call (``dgpp.text.grammar``)."""

from __future__ import annotations

import re
from typing import Any

from dgpp.serve.errors import invalid, unsupported

TYPES = ("text", "json_object", "json_schema")
_SCHEMA_KEYS = ("name", "description", "schema", "strict")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_response_format(fmt: dict[str, Any] | None) -> None:
    if fmt is None:
        return
    if "type" not in fmt:
        raise invalid(f"response_format.type is required (one of {', '.join(TYPES)})", "response_format.type")
    for key in fmt:
        if key not in ("type", "json_schema"):
            raise unsupported(f"response_format.{key}", "is not a response_format field (type, json_schema)")
    kind = fmt["type"]
    if kind not in TYPES:
        raise invalid(
            f"response_format.type {kind!r} is not one of {', '.join(TYPES)}", "response_format.type"
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
