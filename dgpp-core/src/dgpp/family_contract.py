"""A family plugin's one declaration: which config.json values it claims, and for each model its config class,
model class and checkpoint renames. Core does the rest (``dgpp.startup.assembly``): build, quantize, load, settle,
convert; the memory plan from the model built on ``meta``; the cache layout from the attention modules.

A plugin's ``plugin.py`` declares ``FAMILY = Family(...)`` and its entry point names that object
(``llama = "dgpp_llama.plugin:FAMILY"``). pluggy registers it like a module of hookimpls; core checks it against
``dgpp.family.FamilyContract`` at registration. References are ``"package.module:name"`` strings, imported on
first use, so registering a plugin loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dgpp.deploy_templates import packaged_templates
from dgpp.errors import PluginError
from dgpp.family import FamilyModel, FamilySpec, LoadContext, resolve_reference, split_reference
from dgpp.hookspecs import PluginHooks, hookimpl

if TYPE_CHECKING:
    from dgpp.media.prompt import ImageInput
    from dgpp.offers import BenchGeometry, GGUFArchitecture, TinyCheckpoint
    from dgpp.step.memory import MemoryPlan, ModelMemory
    from dgpp.step.model import BlockDrafter, Drafter, Model
    from dgpp.text.dialect import Dialect


@dataclass(frozen=True, eq=False)  # identity hash: pluggy may hash the bound hookimpls
class Family(PluginHooks):
    """Everything a family plugin tells dgpp. ``architectures`` / ``model_types`` are the config.json values it
    claims; the ``models`` implement some of them (a claimed value no model implements is refused as "not yet
    supported"). ``dialect`` / ``chat_template``: ``function(hf_config)`` references; ``templates_package``:
    the plugin's package (``__name__``), whose ``templates/*.json`` ship as deployment templates. ``image_input``:
    a ``function(hf_config, checkpoint_dir)`` reference returning the ``dgpp.media.prompt.ImageInput`` of a
    checkpoint whose model has a vision encoder (None for a text-only one).
    ``tiny_checkpoints`` / ``bench_geometries`` / ``gguf_architectures``: functions of no argument returning the
    family's ``dgpp.offers`` (tiny random checkpoints in its releases' layouts, benchmark geometries, GGUF
    maps). Subclassing ``PluginHooks`` lets a type checker hold every hook below to its spec."""

    name: str
    plugin: str
    architectures: tuple[str, ...]
    models: tuple[FamilyModel, ...]
    model_types: tuple[str, ...] = ()
    description: str = ""
    dialect: str | None = None
    chat_template: str | None = None
    templates_package: str | None = None
    tiny_checkpoints: str | None = None
    bench_geometries: str | None = None
    gguf_architectures: str | None = None
    image_input: str | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse a declaration that could never work, at registration (not at the first request)."""
        claimed = {*self.architectures, *self.model_types}
        seen: set[str] = set()
        for entry in self.models:
            stray = [v for v in entry.claims if v not in claimed]
            if stray:
                raise PluginError(
                    f"family {self.name} (plugin {self.plugin}): a model loads {', '.join(stray)} "
                    "without the family claiming it: add it to architectures or model_types"
                )
            twice = seen.intersection(entry.claims)
            if twice:
                raise PluginError(f"family {self.name}: {', '.join(sorted(twice))} is loaded by two models")
            seen.update(entry.claims)
            unknown = sorted(set(entry.hooks) - set(entry.OWN_HOOKS))
            if unknown:
                raise PluginError(
                    f"family {self.name}: unknown model hooks {', '.join(unknown)} "
                    f"(known: {', '.join(entry.OWN_HOOKS)})"
                )
            for reference in entry.references():
                split_reference(reference)
        for optional in (
            self.dialect,
            self.chat_template,
            self.image_input,
            self.tiny_checkpoints,
            self.bench_geometries,
            self.gguf_architectures,
        ):
            if optional is not None:
                split_reference(optional)

    def families(self) -> list[FamilySpec]:
        implemented = tuple(v for entry in self.models for v in entry.claims)
        return [
            FamilySpec(
                name=self.name,
                plugin=self.plugin,
                architectures=self.architectures,
                model_types=self.model_types,
                implemented=implemented,
                description=self.description,
            )
        ]

    def model_entry(self, ctx: LoadContext) -> FamilyModel | None:
        """The model that loads ``ctx``'s checkpoint (matched on its architecture, then its model_type)."""
        if ctx.family != self.name:
            return None
        for value in (ctx.architecture, ctx.hf_config.get("model_type")):
            for entry in self.models:
                if value in entry.claims:
                    return entry
        return None

    def _function(self, reference: str | None, family: str) -> Callable[..., Any] | None:
        if reference is None or family != self.name:
            return None
        function: Callable[..., Any] = resolve_reference(reference)
        return function

    def _offers(self, reference: str | None) -> list[Any]:
        return [] if reference is None else list(resolve_reference(reference)())

    @hookimpl
    def dgpp_families(self) -> list[FamilySpec]:
        return self.families()

    @hookimpl
    def dgpp_load_model(self, ctx: LoadContext) -> Model | None:
        from dgpp.startup.assembly import load_declared_model

        entry = self.model_entry(ctx)
        return None if entry is None else load_declared_model(ctx, entry)

    @hookimpl
    def dgpp_build_model(self, ctx: LoadContext) -> Model | None:
        from dgpp.startup.assembly import build_declared_model

        entry = self.model_entry(ctx)
        return None if entry is None else build_declared_model(ctx, entry)

    @hookimpl
    def dgpp_memory_plan(self, ctx: LoadContext) -> ModelMemory | MemoryPlan | None:
        from dgpp.startup.assembly import declared_model_memory

        entry = self.model_entry(ctx)
        return None if entry is None else declared_model_memory(ctx, entry)

    @hookimpl
    def dgpp_build_draft(self, ctx: LoadContext, model: Model) -> Drafter | BlockDrafter | None:
        entry = self.model_entry(ctx)
        if entry is None or entry.drafter is None:
            return None
        drafter: Drafter | BlockDrafter | None = resolve_reference(entry.drafter)(ctx, model)
        return drafter

    @hookimpl
    def dgpp_tool_dialect(self, family: str, hf_config: dict[str, Any]) -> Dialect | None:
        impl = self._function(self.dialect, family)
        dialect: Dialect | None = None if impl is None else impl(hf_config)
        return dialect

    @hookimpl
    def dgpp_chat_template(self, family: str, hf_config: dict[str, Any]) -> str | None:
        impl = self._function(self.chat_template, family)
        template: str | None = None if impl is None else impl(hf_config)
        return template

    @hookimpl
    def dgpp_image_input(
        self, family: str, hf_config: dict[str, Any], checkpoint_dir: str
    ) -> ImageInput | None:
        impl = self._function(self.image_input, family)
        found: ImageInput | None = None if impl is None else impl(hf_config, checkpoint_dir)
        return found

    @hookimpl
    def dgpp_deploy_templates(self) -> list[Path]:
        return packaged_templates(self.templates_package) if self.templates_package else []

    @hookimpl
    def dgpp_tiny_checkpoints(self) -> list[TinyCheckpoint]:
        return self._offers(self.tiny_checkpoints)

    @hookimpl
    def dgpp_bench_geometries(self) -> list[BenchGeometry]:
        return self._offers(self.bench_geometries)

    @hookimpl
    def dgpp_gguf_architectures(self) -> list[GGUFArchitecture]:
        return self._offers(self.gguf_architectures)
