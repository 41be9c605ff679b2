"""Which JSON-schema keywords the structured-output backend enforces, and a walk that finds the first one it
would not.

llguidance fails loudly on the keywords it has not implemented (``not``, ``if``, ``uniqueItems``,
``contains``, ``propertyNames``, ...), but it silently skips every keyword it does not know, and some of those
constrain a value: ``contentEncoding: base64`` let ``"!!"`` through, ``discriminator`` let an object without its
property through (measured with llguidance's matcher on violating JSON). A constrained answer must never
violate its schema, so a schema is refused, naming the keyword and where it sits, unless every key of every
subschema is one llguidance enforces, an annotation that constrains nothing, or a vendor extension (``x-``).
"""

from __future__ import annotations

from typing import Any

# enforced by llguidance (each checked against a violating value), or refused by it with its own error
ENFORCED = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "additionalItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "anyOf",
        "allOf",
        "oneOf",
        "$ref",
        "$defs",
        "definitions",
        # not implemented: llguidance answers with a clear error of its own, which the caller passes on
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# annotations: they describe a value without constraining it (``nullable`` only widens ``type``, so output
# valid without it is valid with it)
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$schema",
        "$id",
        "$anchor",
        "$dynamicAnchor",
        "$recursiveAnchor",
        "$vocabulary",
        "deprecated",
        "readOnly",
        "writeOnly",
        "nullable",
    }
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = (
    "additionalProperties",
    "additionalItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def unenforced_keyword(schema: Any, path: str = "") -> tuple[str, str] | None:
    """``(keyword, JSON pointer of its subschema)`` for the first keyword of ``schema`` that the backend would
    ignore, or None when it enforces (or refuses by itself) everything the schema says."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key not in ENFORCED and key not in ANNOTATIONS and not key.startswith("x-"):
            return key, path or "/"
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                if (found := unenforced_keyword(value, f"{path}/{key}/{_escape(name)}")) is not None:
                    return found
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                if (found := unenforced_keyword(value, f"{path}/{key}/{i}")) is not None:
                    return found
    items = schema.get("items")
    for i, value in enumerate(items if isinstance(items, list) else [items]):
        where = f"{path}/items/{i}" if isinstance(items, list) else f"{path}/items"
        if (found := unenforced_keyword(value, where)) is not None:
            return found
    for key in _SCHEMA_VALUES:
        if (found := unenforced_keyword(schema.get(key), f"{path}/{key}")) is not None:
            return found
    return None


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
