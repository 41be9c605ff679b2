"""The format registry: core's built-ins plus whatever plugins add through ``dgpp_quant_formats``.

The plugins' answers are handed in by the composition root: ``dgpp.plugins.manager()`` gives them to
``dgpp.handoff`` when it builds the process-wide plugin manager, so this layer never imports the plugin
layer above it. Before that only core's built-ins are known, and an unknown name says so.
"""

from __future__ import annotations

from functools import lru_cache

from dgpp.errors import ConfigError
from dgpp.handoff import FormatAnswers, plugin_format_answers
from dgpp.quant.builtin_formats import builtin_formats
from dgpp.quant.format import QuantFormat


@lru_cache(maxsize=2)
def _formats(answers: FormatAnswers | None) -> dict[str, QuantFormat]:
    out: dict[str, QuantFormat] = {}
    for answer in answers() if answers is not None else ():
        for fmt in answer or ():
            out.setdefault(fmt.name, fmt)
    for fmt in builtin_formats():  # available even when the plugin manager is built without core
        out.setdefault(fmt.name, fmt)
    return out


def registered_formats() -> dict[str, QuantFormat]:
    """Every format answered by the ``dgpp_quant_formats`` hook, by name (first registration wins)."""
    return _formats(plugin_format_answers())  # read once per plugin manager


def get_format(name: str, **params) -> QuantFormat:
    """The registered format ``name`` configured with ``params`` (e.g. ``block=(128, 128)``)."""
    try:
        proto = registered_formats()[name]
    except KeyError:
        known = ", ".join(sorted(registered_formats()))
        message = f"unknown weight format {name!r} (known: {known})"
        if plugin_format_answers() is None:
            message += (
                "; plugin formats are not registered yet: dgpp.plugins.manager() registers them when built"
            )
        raise ConfigError(message) from None
    return proto.with_params(**params) if params else proto
