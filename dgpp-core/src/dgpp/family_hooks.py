"""The hookimpls every family plugin repeats, built once from a ``FamilySpec`` and lazy references.

Each family's per-family hooks have the same shape: answer only for your own family, import the
implementation on first call (so registering a plugin imports no torch-heavy module), and hand it the
hook's arguments. ``FamilyHooks`` holds that shape; a plugin's ``plugin.py`` declares one, with its spec and
the ``"module:function"`` references, and its entry point names that object (``"dgpp_toy.plugin:HOOKS"``).
pluggy registers it like a module: it lists the object's attributes (``dir``), which name only the hooks
given a reference, and the bound methods of ``hookimpl``-marked functions carry the marker.

Writing the hookimpls by hand, one ``@hookimpl`` function each, keeps working: this is a convenience.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dgpp.deploy_templates import packaged_templates
from dgpp.errors import PluginError
from dgpp.family import FamilySpec, LoadContext, resolve_reference, split_reference
from dgpp.hookspecs import hookimpl

if TYPE_CHECKING:
    from dgpp.step.memory import MemoryPlan, ModelMemory
    from dgpp.step.model import Drafter, Model
    from dgpp.text.dialect import Dialect

# hook name -> the FamilyHooks field holding its implementation reference
_REFERENCED_HOOKS = {
    "dgpp_load_model": "load_model",
    "dgpp_build_model": "build_model",
    "dgpp_tool_dialect": "tool_dialect",
    "dgpp_chat_template": "chat_template",
    "dgpp_build_draft": "build_draft",
    "dgpp_memory_plan": "memory_plan",
}


@dataclass(frozen=True, eq=False)  # identity hash: pluggy may hash the bound hookimpls
class FamilyHooks:
    """One family's hookimpls, answering only for ``spec.name``.

    Each reference is ``"package.module:function"``, imported on first use and called with the hook's
    arguments minus the family: ``load_model(ctx)``, ``tool_dialect(hf_config)``,
    ``chat_template(hf_config)``, ``build_draft(ctx, model)``, ``memory_plan(ctx)``, ``build_model(ctx)``. A hook left as None
    is not exported, so the plugin does not take part in it. ``only_model_types`` narrows a hook to some
    of the family's config ``model_type`` values (e.g. ``{"memory_plan": ("qwen4_exp",)}``): for the
    others it returns None and the engine's generic behaviour applies. ``templates_package`` (the plugin's
    module name, ``__name__``) ships the ``*.json`` in that package's ``templates/`` folder through
    ``dgpp_deploy_templates``.
    """

    spec: FamilySpec
    load_model: str
    tool_dialect: str | None = None
    chat_template: str | None = None
    build_draft: str | None = None
    memory_plan: str | None = None
    build_model: str | None = None
    templates_package: str | None = None
    only_model_types: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a restriction on an unknown hook name would silently restrict nothing
        unknown = sorted(set(self.only_model_types) - set(_REFERENCED_HOOKS.values()))
        if unknown:
            raise PluginError(
                f"family {self.spec.name}: only_model_types names unknown hooks {', '.join(unknown)} "
                f"(known: {', '.join(_REFERENCED_HOOKS.values())})"
            )
        for attr in _REFERENCED_HOOKS.values():  # a typo surfaces at registration, not at first request
            reference = getattr(self, attr)
            if reference is not None:
                split_reference(reference)

    def _implementation(self, hook: str, family: str, hf_config: Mapping[str, Any]) -> Callable[..., Any] | None:
        """The referenced function when this hook should answer for ``family`` / ``hf_config``, else None."""
        if family != self.spec.name:
            return None
        allowed = self.only_model_types.get(hook)
        if allowed is not None and hf_config.get("model_type") not in allowed:
            return None
        reference = getattr(self, hook)
        return None if reference is None else resolve_reference(reference)

    @hookimpl
    def dgpp_families(self) -> list[FamilySpec]:
        return [self.spec]

    @hookimpl
    def dgpp_load_model(self, ctx: LoadContext) -> Model | None:
        impl = self._implementation("load_model", ctx.family, ctx.hf_config)
        return None if impl is None else impl(ctx)

    @hookimpl
    def dgpp_build_model(self, ctx: LoadContext) -> Model | None:
        impl = self._implementation("build_model", ctx.family, ctx.hf_config)
        return None if impl is None else impl(ctx)

    @hookimpl
    def dgpp_tool_dialect(self, family: str, hf_config: dict) -> Dialect | None:
        impl = self._implementation("tool_dialect", family, hf_config)
        return None if impl is None else impl(hf_config)

    @hookimpl
    def dgpp_chat_template(self, family: str, hf_config: dict) -> str | None:
        impl = self._implementation("chat_template", family, hf_config)
        return None if impl is None else impl(hf_config)

    @hookimpl
    def dgpp_build_draft(self, ctx: LoadContext, model: Model) -> Drafter | None:
        impl = self._implementation("build_draft", ctx.family, ctx.hf_config)
        return None if impl is None else impl(ctx, model)

    @hookimpl
    def dgpp_memory_plan(self, ctx: LoadContext) -> ModelMemory | MemoryPlan | None:
        impl = self._implementation("memory_plan", ctx.family, ctx.hf_config)
        return None if impl is None else impl(ctx)

    @hookimpl
    def dgpp_deploy_templates(self) -> list[Path]:
        return packaged_templates(self.templates_package) if self.templates_package else []

    def hookimpls(self) -> dict[str, Callable[..., Any]]:
        """``{hook name: bound hookimpl}`` for ``dgpp_families`` and every hook with a reference: what pluggy
        registers for this object (e.g. to place the hooks in a module beside hand-written ones)."""
        exported: dict[str, Callable[..., Any]] = {"dgpp_families": self.dgpp_families}
        for hook, attr in _REFERENCED_HOOKS.items():
            if getattr(self, attr) is not None:
                exported[hook] = getattr(self, hook)
        if self.templates_package is not None:
            exported["dgpp_deploy_templates"] = self.dgpp_deploy_templates
        return exported

    def __dir__(self) -> list[str]:
        """The attributes pluggy scans for hookimpls: a hook left without a reference is not listed, so it is
        not registered at all (the plugin takes no part in it)."""
        unexported = {*_REFERENCED_HOOKS, "dgpp_deploy_templates"} - set(self.hookimpls())
        return [name for name in super().__dir__() if name not in unexported]
