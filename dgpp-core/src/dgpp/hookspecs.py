"""The dgpp plugin API: every hook a plugin may implement, and nothing else.

Hooks are factories called at startup (or by ``dgpp check`` / ``dgpp plugins``); nothing on the
per-token path goes through pluggy. A plugin is an object registered under the entry-point group
``dgpp`` (a family's ``dgpp.family_contract.Family``, or a module) whose ``dgpp_*`` functions are decorated with
``dgpp.hookimpl``. Every type these hooks take or return is importable from ``dgpp.plugin_api``.

The hooks are the methods of ``PluginHooks``, which is also a base class: a plugin class that subclasses it
(``Family`` does) has each ``@hookimpl`` method checked by a type checker against its spec, so a wrong
signature fails ``mypy`` (the test command's gate) instead of a request at run time. Only methods marked
``@hookimpl`` register; the inherited specs take no part.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # the types stay out of the import: registering a plugin must not load torch
    from dgpp.family import FamilySpec, LoadContext
    from dgpp.media.prompt import ImageInput
    from dgpp.offers import BenchGeometry, GGUFArchitecture, TinyCheckpoint
    from dgpp.quant.format import QuantFormat
    from dgpp.step.memory import MemoryPlan, ModelMemory
    from dgpp.step.model import BlockDrafter, Drafter, Model
    from dgpp.text.dialect import Dialect

PROJECT = "dgpp"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PluginHooks:
    """The hook specifications (their bodies are documentation: pluggy calls the implementations)."""

    @hookspec
    def dgpp_families(self) -> list[FamilySpec]:
        """Return the model families this plugin provides.

        Each ``FamilySpec`` names the HF ``architectures`` / ``model_type`` values it claims and which of
        them it implements. Two plugins claiming one value is a startup error naming both.
        """

    @hookspec(firstresult=True)
    def dgpp_load_model(self, ctx: LoadContext) -> Model | None:
        """Build and load the model for ``ctx`` (only the plugin whose family is ``ctx.family`` answers).

        Returns a ``dgpp.step.model.Model`` with its weights loaded and sliced for ``ctx.world``;
        return None for a family that is not yours. Raise ``CheckpointError`` naming the tensor and the
        file for missing or mis-shaped tensors, ``ConfigError`` naming the key for unsupported values.
        """

    @hookspec(firstresult=True)
    def dgpp_build_model(self, ctx: LoadContext) -> Model | None:
        """Build the model for ``ctx.hf_config`` on ``ctx.device`` with its parameters allocated but not loaded
        (``dgpp bench`` fills them with random values of a real geometry); None for a family that is not yours."""

    @hookspec(firstresult=True)
    def dgpp_build_draft(self, ctx: LoadContext, model: Model) -> Drafter | BlockDrafter | None:
        """Build the speculative drafter (an MTP layer, a block drafter) for ``model``, weights loaded, or None.

        An MTP drafter follows ``dgpp.step.model.Drafter``: ``drafter(batch, previous_hidden, step)`` and
        ``compute_logits(hidden, step)``; a block drafter ``dgpp.step.model.BlockDrafter``: ``absorb(batch,
        features)`` and ``draft(batch)``.
        """

    @hookspec(firstresult=True)
    def dgpp_memory_plan(self, ctx: LoadContext) -> ModelMemory | MemoryPlan | None:
        """Return the model's own bytes per rank for ``ctx`` (a ``dgpp.step.memory.ModelMemory``) without
        loading weights: weights (packed bytes for quantized formats), drafter, KV bytes per token, state bytes per
        request, activation bytes per prefill row. Core sizes the deployment's plan from them
        (``dgpp.step.memory.plan_memory``) and refuses to start when it does not fit. Return None for a family
        that is not yours (the generic estimate then applies). A complete ``MemoryPlan`` is taken as it is.
        """

    @hookspec
    def dgpp_quant_formats(self) -> list[QuantFormat]:
        """Return weight formats (``dgpp.quant.QuantFormat``) this plugin adds; core registers its own
        built-ins through this same hook."""

    @hookspec
    def dgpp_deploy_templates(self) -> list[Path]:
        """Return paths of deployment templates (JSON) this plugin ships, for ``dgpp templates``."""

    @hookspec(firstresult=True)
    def dgpp_chat_template(self, family: str, hf_config: dict[str, Any]) -> str | None:
        """Return a fallback Jinja chat template for a checkpoint of ``family`` that ships none."""

    @hookspec(firstresult=True)
    def dgpp_tool_dialect(self, family: str, hf_config: dict[str, Any]) -> Dialect | None:
        """Return the family's tool-call / reasoning dialect (``dgpp.text.dialect.Dialect``), or None."""

    @hookspec(firstresult=True)
    def dgpp_image_input(
        self, family: str, hf_config: dict[str, Any], checkpoint_dir: str
    ) -> ImageInput | None:
        """Return the image preprocessing and prompt layout (``dgpp.media.prompt.ImageInput``) of a checkpoint of
        ``family`` whose model reads images through its own vision encoder, or None for a text-only checkpoint."""

    @hookspec
    def dgpp_tiny_checkpoints(self) -> list[TinyCheckpoint]:
        """Return the tiny random checkpoints (``dgpp.offers.TinyCheckpoint``) of this plugin's families, by name:
        the tests' ``dgpp.testing.builders.build_tiny_checkpoint(name, ...)`` and the CPU demo build through them."""

    @hookspec
    def dgpp_bench_geometries(self) -> list[BenchGeometry]:
        """Return the real geometries (``dgpp.offers.BenchGeometry``: HF config fields) ``dgpp bench --geometry``
        can run with random weights for this plugin's families."""

    @hookspec
    def dgpp_gguf_architectures(self) -> list[GGUFArchitecture]:
        """Return how GGUF files of an architecture (``general.architecture``) map onto checkpoints this plugin
        loads (``dgpp.offers.GGUFArchitecture``); core converts such a file with it."""
