"""Core's own hook implementations (registered like any plugin): the built-in quant formats and the demo template."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dgpp.deploy_templates import packaged_templates
from dgpp.hookspecs import hookimpl

if TYPE_CHECKING:
    from dgpp.quant.format import QuantFormat


@hookimpl
def dgpp_quant_formats() -> list[QuantFormat]:
    from dgpp.quant.builtin_formats import builtin_formats  # on first use: listing plugins loads no torch

    return builtin_formats()


@hookimpl
def dgpp_deploy_templates() -> list[Path]:
    """The CPU demo's template (dgpp/templates/, a link to the repository's deploy/demo_cpu.json)."""
    return packaged_templates(__name__)
