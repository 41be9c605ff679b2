"""Core's own hook implementations (registered like any plugin): the built-in quant formats."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgpp.hookspecs import hookimpl

if TYPE_CHECKING:
    from dgpp.quant.format import QuantFormat


@hookimpl
def dgpp_quant_formats() -> list[QuantFormat]:
    from dgpp.quant.builtin_formats import builtin_formats  # on first use: listing plugins loads no torch

    return builtin_formats()
