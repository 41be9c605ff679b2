"""Plugin discovery: entry points in group ``dgpp``, an optional ``DGPP_PLUGINS`` allow-list.

Core never imports a plugin by name. ``DGPP_PLUGINS`` is a comma-separated list of entry-point
names; when set, only those load (and a listed name that is not installed is an error). Two
plugins claiming one architecture / model_type is a startup error naming both.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from dgpp import hookspecs
from dgpp.errors import PluginError, UnsupportedModelError
from dgpp.family import FamilyContract, FamilySpec
from dgpp.handoff import provide_plugin_formats

ENTRY_POINT_GROUP = "dgpp"
ALLOW_ENV = "DGPP_PLUGINS"
CORE_NAME = "dgpp-core"


@dataclass(frozen=True)
class Resolution:
    """Which family (and plugin) serves a checkpoint, and by which config value it was matched."""

    family: FamilySpec
    matched: str


def _allow_list() -> set[str] | None:
    raw = os.environ.get(ALLOW_ENV, "").strip()
    if not raw:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _dist_label(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else ep.value


def installed_entry_points() -> dict[str, EntryPoint]:
    """Installed ``dgpp`` entry points by name; two distributions using one name is an error."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        prev = found.get(ep.name)
        if prev is not None and prev.value != ep.value:
            raise PluginError(
                f"two installed plugins use the entry-point name {ep.name!r}: "
                f"{_dist_label(prev)} ({prev.value}) and {_dist_label(ep)} ({ep.value})"
            )
        found[ep.name] = ep
    return found


def build_manager(allow: set[str] | None = None, extra: Iterable[Any] = ()) -> pluggy.PluginManager:
    """A PluginManager with core's built-ins plus every allowed installed plugin (and ``extra`` modules).

    ``allow`` overrides ``DGPP_PLUGINS``; ``extra`` registers modules directly (tests, embedding).
    """
    from dgpp import builtin

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs.PluginHooks)
    pm.register(builtin, name=CORE_NAME)
    allow = _allow_list() if allow is None else allow
    found = installed_entry_points()
    if allow is not None:
        missing = sorted(allow - set(found))
        if missing:
            raise PluginError(
                f"{ALLOW_ENV} names plugins that are not installed: {', '.join(missing)} "
                f"(installed: {', '.join(sorted(found)) or 'none'})"
            )
    for name, ep in sorted(found.items()):
        if allow is not None and name not in allow:
            continue
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must say which one, not crash with an anonymous traceback
            raise PluginError(
                f"plugin {name!r} ({_dist_label(ep)}) failed to load: {type(exc).__name__}: {exc}; "
                f"fix or uninstall it, or leave it out with {ALLOW_ENV}"
            ) from exc
        check_contract(name, ep, module)
        pm.register(module, name=name)
    for module in extra:
        pm.register(module, name=getattr(module, "__name__", None))
    families(pm)  # duplicate claims are a startup error, found here rather than at first use
    return pm


def check_contract(name: str, ep: EntryPoint, plugin: Any) -> None:
    """A plugin that declares families does so through the one contract (``dgpp.plugin_api.Family``, checked
    against ``FamilyContract``), so every family is built, loaded and planned by core the same way. A plugin
    that adds no family (e.g. only weight formats) may be a module of hookimpls."""
    if isinstance(plugin, FamilyContract):
        plugin.check()
        return
    if hasattr(plugin, "dgpp_families"):
        raise PluginError(
            f"plugin {name!r} ({_dist_label(ep)}) declares families with hand-written hooks; declare them with "
            f"dgpp.plugin_api.Family and point the entry point at that object (docs/plugin-authoring.md)"
        )


@lru_cache(maxsize=1)
def manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built once); it hands the quant-format registry its plugins' formats."""
    pm = build_manager()
    provide_plugin_formats(pm.hook.dgpp_quant_formats)
    return pm


def answers_by_plugin(pm: pluggy.PluginManager, hook: str) -> list[tuple[str, Any]]:
    """Call a list-returning hook on each plugin separately: ``[(plugin name, its answer)]`` in registration order.

    ``pm.hook.X()`` merges the answers; listings and error messages need to know who said what.
    """
    caller = getattr(pm.hook, hook)
    return [(impl.plugin_name, impl.function()) for impl in caller.get_hookimpls()]


def families(pm: pluggy.PluginManager) -> list[FamilySpec]:
    """All declared families; raises PluginError when two plugins claim one architecture/model_type."""
    out: list[FamilySpec] = []
    owner: dict[str, tuple[str, FamilySpec]] = {}
    for plugin_name, batch in answers_by_plugin(pm, "dgpp_families"):
        for fam in batch or []:
            for value in dict.fromkeys((*fam.architectures, *fam.model_types)):
                prev = owner.get(value)
                if prev is not None:
                    raise PluginError(
                        f"architecture {value!r} is claimed by two plugins: "
                        f"{prev[0]} (family {prev[1].name}) and {plugin_name} (family {fam.name}); "
                        f"uninstall one or choose with {ALLOW_ENV}"
                    )
                owner[value] = (plugin_name, fam)
            out.append(fam)
    return sorted(out, key=lambda f: (f.plugin, f.name))


def resolve(pm: pluggy.PluginManager, hf_config: dict) -> Resolution:
    """Pick the family for a checkpoint: the first ``architectures`` entry, else ``model_type``.

    A family that claims the checkpoint but implements none of its values is refused as
    "not yet supported" (never a crash further in).
    """
    archs = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type", "")
    candidates = [a for a in archs[:1] if a] + ([model_type] if model_type else [])
    fams = families(pm)
    for value in candidates:
        for fam in fams:
            if not fam.claims(value):
                continue
            usable = [c for c in candidates if fam.implements(c)]
            if not usable:
                raise UnsupportedModelError(
                    f"{value!r} is claimed by plugin {fam.plugin} (family {fam.name}) "
                    f"but is not yet supported; implemented: {', '.join(fam.implemented) or 'none'}"
                )
            return Resolution(fam, usable[0])
    claimed = sorted({v for f in fams for v in (*f.architectures, *f.model_types)})
    raise UnsupportedModelError(
        f"no installed plugin claims architectures={archs!r} model_type={model_type!r}; "
        f"claimed: {', '.join(claimed) or 'none (install a plugin, e.g. dgpp-qwen)'}"
    )
