"""The installed plugins' offers by name (``dgpp.offers``): tiny checkpoints, bench geometries, GGUF maps.

Core names no family: ``dgpp bench --geometry X``, the demo's tiny model, a GGUF file's ``general.architecture``
and the tests' ``build_tiny_checkpoint(kind)`` all ask the installed plugins through these. Two plugins offering
one name is an error naming both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from dgpp.errors import PluginError
from dgpp.offers import BenchGeometry, GGUFArchitecture, TinyCheckpoint
from dgpp.plugins import answers_by_plugin, manager

if TYPE_CHECKING:
    import pluggy

Offer = TypeVar("Offer", TinyCheckpoint, BenchGeometry, GGUFArchitecture)


def _by_name(pm: pluggy.PluginManager, hook: str, what: str) -> dict[str, Any]:
    """Every plugin's answers to list-returning ``hook`` by name; one name offered twice is a PluginError."""
    found: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for plugin_name, batch in answers_by_plugin(pm, hook):
        for offer in batch or []:
            if offer.name in owner:
                raise PluginError(
                    f"{what} {offer.name!r} is offered by two plugins: {owner[offer.name]} and {plugin_name}"
                )
            owner[offer.name] = plugin_name
            found[offer.name] = offer
    return found


def _manager(pm: pluggy.PluginManager | None) -> pluggy.PluginManager:
    return manager() if pm is None else pm


def _one(offers: dict[str, Offer], name: str, what: str, hook: str) -> Offer:
    offer = offers.get(name)
    if offer is None:
        raise PluginError(
            f"no installed plugin offers the {what} {name!r} ({hook}); offered: {', '.join(sorted(offers)) or 'none'}"
        )
    return offer


def tiny_checkpoints(pm: pluggy.PluginManager | None = None) -> dict[str, TinyCheckpoint]:
    """Every installed plugin's tiny checkpoints by name."""
    return _by_name(_manager(pm), "dgpp_tiny_checkpoints", "tiny checkpoint")


def tiny_checkpoint(name: str, pm: pluggy.PluginManager | None = None) -> TinyCheckpoint:
    """The tiny checkpoint ``name``; a name no plugin offers is a PluginError listing those offered."""
    return _one(tiny_checkpoints(pm), name, "tiny checkpoint", "dgpp_tiny_checkpoints")


def bench_geometries(pm: pluggy.PluginManager | None = None) -> dict[str, BenchGeometry]:
    """Every installed plugin's benchmark geometries by name."""
    return _by_name(_manager(pm), "dgpp_bench_geometries", "bench geometry")


def bench_geometry(name: str, pm: pluggy.PluginManager | None = None) -> BenchGeometry:
    """The benchmark geometry ``name``; a name no plugin offers is a PluginError listing those offered."""
    return _one(bench_geometries(pm), name, "bench geometry", "dgpp_bench_geometries")


def gguf_architectures(pm: pluggy.PluginManager | None = None) -> dict[str, GGUFArchitecture]:
    """Every installed plugin's GGUF architecture maps by ``general.architecture``."""
    return _by_name(_manager(pm), "dgpp_gguf_architectures", "GGUF architecture")
