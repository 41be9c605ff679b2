"""Core's own hook implementations (registered like any plugin): the built-in quant formats and the demo template."""

from __future__ import annotations

from pathlib import Path

from dgpp.deploy_templates import packaged_templates
from dgpp.hookspecs import hookimpl


@hookimpl
def dgpp_quant_formats() -> list:
    try:
        from dgpp.quant.registry import builtin_formats
    except ImportError:  # quant formats land with their own issue
        return []
    return builtin_formats()


@hookimpl
def dgpp_deploy_templates() -> list[Path]:
    """The CPU demo's template (dgpp/templates/, a link to the repository's deploy/demo_cpu.json)."""
    return packaged_templates(__name__)
