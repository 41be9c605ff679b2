"""The dgpp plugin API: every hook a plugin may implement, and nothing else.

Hooks are factories called at startup (or by ``dgpp check`` / ``dgpp plugins``); nothing on the
per-token path goes through pluggy. A plugin is a module registered under the entry-point group
``dgpp`` whose functions are decorated with ``dgpp.hookimpl``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from dgpp.family import FamilySpec, LoadContext

PROJECT = "dgpp"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def dgpp_families() -> list[FamilySpec]:
    """Return the model families this plugin provides.

    Each ``FamilySpec`` names the HF ``architectures`` / ``model_type`` values it claims and which of
    them it implements. Two plugins claiming one value is a startup error naming both.
    """


@hookspec(firstresult=True)
def dgpp_load_model(ctx: LoadContext) -> Any:
    """Build and load the model for ``ctx`` (only the plugin whose family is ``ctx.family`` answers).

    Returns a ``dgpp.engine.model.Model`` with its weights loaded and sliced for ``ctx.world``;
    return None for a family that is not yours. Raise ``CheckpointError`` naming the tensor and the
    file for missing or mis-shaped tensors, ``ConfigError`` naming the key for unsupported values.
    """


@hookspec(firstresult=True)
def dgpp_build_model(ctx: LoadContext) -> Any:
    """Build the model for ``ctx.hf_config`` on ``ctx.device`` with its parameters allocated but not loaded
    (``dgpp bench`` fills them with random values of a real geometry); None for a family that is not yours."""


@hookspec(firstresult=True)
def dgpp_build_draft(ctx: LoadContext, model: Any) -> Any:
    """Build the speculative drafter (an MTP layer, a block drafter) for ``model``, or None."""


@hookspec(firstresult=True)
def dgpp_memory_plan(ctx: LoadContext) -> Any:
    """Return a ``dgpp.engine.memory.MemoryPlan`` for ``ctx`` without loading weights.

    Itemized bytes per rank: weights (packed bytes for quantized formats), KV bytes per token, state
    bytes per request, activation bytes per prefill token, drafter. The engine sizes its pools from
    it and refuses to start when it does not fit. Return None for a family that is not yours.
    """


@hookspec
def dgpp_quant_formats() -> list[Any]:
    """Return weight formats (``dgpp.quant.QuantFormat``) this plugin adds; core registers its own
    built-ins through this same hook."""


@hookspec
def dgpp_deploy_templates() -> list[Any]:
    """Return paths of deployment templates (JSON) this plugin ships, for ``dgpp templates``."""


@hookspec(firstresult=True)
def dgpp_chat_template(family: str, hf_config: dict) -> str | None:
    """Return a fallback Jinja chat template for a checkpoint of ``family`` that ships none."""


@hookspec(firstresult=True)
def dgpp_tool_dialect(family: str, hf_config: dict) -> Any:
    """Return the family's tool-call / reasoning dialect (``dgpp.text.dialect.Dialect``), or None."""
