"""Core's own hook implementations (registered like any plugin): the built-in quant formats."""

from __future__ import annotations

from dgpp.hookspecs import hookimpl


@hookimpl
def dgpp_quant_formats() -> list:
    try:
        from dgpp.quant.registry import builtin_formats
    except ImportError:  # quant formats land with their own issue
        return []
    return builtin_formats()
