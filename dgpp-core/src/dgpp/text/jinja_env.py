"""The Jinja environment chat templates run in, built to behave exactly as HF transformers' does.

Sandboxed and immutable (templates are untrusted code from the checkpoint), ``trim_blocks`` and
``lstrip_blocks``, loop controls, ``{% generation %}`` blocks accepted (rendered as their body), HF's
``tojson`` (no HTML escaping, ``ensure_ascii=False``), ``raise_exception``, ``strftime_now``, and a
``namespace`` that refuses underscore-prefixed attributes.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlocks(jinja2.ext.Extension):
    """Parses ``{% generation %}…{% endgeneration %}`` (HF's assistant-mask marker) and renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictFactory:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attribute {name!r}"
            )


@lru_cache(maxsize=1)
def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=32)
def compile_template(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """The compiled template and the names it reads from its context (what kwargs it can accept)."""
    from jinja2 import meta

    env = environment()
    names = frozenset(meta.find_undeclared_variables(env.parse(source)))
    return env.from_string(source), names
