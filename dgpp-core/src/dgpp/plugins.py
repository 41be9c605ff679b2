"""Plugin discovery: entry points in group ``dgpp``, an optional ``DGPP_PLUGINS`` allow-list.

Core never imports a plugin by name. ``DGPP_PLUGINS`` is a comma-separated list of entry-point
names; when set, only those load (and a listed name that is not installed is an error).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any

import pluggy

from dgpp import hookspecs
from dgpp.errors import PluginError, UnsupportedModelError
from dgpp.family import FamilySpec

ENTRY_POINT_GROUP = "dgpp"
ALLOW_ENV = "DGPP_PLUGINS"


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


def build_manager(allow: set[str] | None = None, extra: list[Any] = ()) -> pluggy.PluginManager:
    """A PluginManager with core's built-ins plus every allowed installed plugin (and ``extra`` modules)."""
    from dgpp import builtin

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="dgpp-core")
    allow = _allow_list() if allow is None else allow
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
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
        pm.register(ep.load(), name=name)
    for module in extra:
        pm.register(module)
    families(pm)  # duplicate claims are a startup error, found here rather than at first use
    return pm


@lru_cache(maxsize=1)
def manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built once)."""
    return build_manager()


def families(pm: pluggy.PluginManager) -> list[FamilySpec]:
    """All declared families; raises PluginError when two plugins claim one architecture/model_type."""
    out: list[FamilySpec] = []
    owner: dict[str, FamilySpec] = {}
    for batch in pm.hook.dgpp_families():
        for fam in batch or []:
            for value in (*fam.architectures, *fam.model_types):
                prev = owner.get(value)
                if prev is not None and prev.plugin != fam.plugin:
                    raise PluginError(
                        f"architecture {value!r} is claimed by two plugins: "
                        f"{prev.plugin} (family {prev.name}) and {fam.plugin} (family {fam.name})"
                    )
                owner[value] = fam
            out.append(fam)
    return sorted(out, key=lambda f: (f.plugin, f.name))


def resolve(pm: pluggy.PluginManager, hf_config: dict) -> Resolution:
    """Pick the family for a checkpoint: the first ``architectures`` entry, else ``model_type``."""
    archs = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type", "")
    candidates = [a for a in archs[:1] if a] + ([model_type] if model_type else [])
    fams = families(pm)
    for value in candidates:
        for fam in fams:
            if fam.claims(value):
                if not fam.implements(value) and not any(fam.implements(c) for c in candidates):
                    raise UnsupportedModelError(
                        f"{value!r} is claimed by plugin {fam.plugin} (family {fam.name}) "
                        f"but is not yet supported; implemented: {', '.join(fam.implemented) or 'none'}"
                    )
                return Resolution(fam, value)
    claimed = sorted({v for f in fams for v in (*f.architectures, *f.model_types)})
    raise UnsupportedModelError(
        f"no installed plugin claims architectures={archs!r} model_type={model_type!r}; "
        f"claimed: {', '.join(claimed) or 'none (install a plugin, e.g. dgpp-qwen)'}"
    )
