"""What ``dgpp serve X`` / ``dgpp check X`` was given, turned into a validated deployment.

``X`` is a template file (``*.json``), a shipped template's name (``qwen_nvfp4_w1``) or a model: a
checkpoint directory, a ``.gguf`` file or an HF id in the local cache. A model gets a world-1 deployment
with every default, the command line's knobs, and (unless ``--kv-capacity`` is given) a KV pool sized to
the memory left: the pool takes what the memory plan's other items leave of ``memory_fraction`` of the
free memory (and never eats into the headroom), capped at every slot holding a full context.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgpp.config import DeployConfig, load_config, parse_config
from dgpp.deploy_templates import deploy_dir
from dgpp.errors import ConfigError, DgppError

DEFAULT_MEMORY_FRACTION = 0.9  # like vLLM's gpu_memory_utilization, but of the memory free at startup
MAX_KV_CAPACITY = 2**40  # engine.kv_capacity's schema bound


@dataclass(frozen=True)
class Target:
    """A resolved ``CONFIG`` argument: a template file to read, or a model to deploy with defaults."""

    template: Path | None = None
    model: str | None = None

    @property
    def label(self) -> str:
        return str(self.template if self.template is not None else self.model)


def classify(arg: str) -> Target:
    """Template file, template name or model, decided from the argument's shape and what exists on disk."""
    path = Path(arg).expanduser()
    if path.is_dir() or path.suffix == ".gguf":
        return Target(model=arg)  # a missing .gguf gets the loader's "not found" message
    if path.suffix == ".json" or path.is_file():
        return Target(template=path)
    if "/" not in arg and not arg.startswith(("~", ".")):
        return Target(template=find_template(arg))
    return Target(model=arg)  # an HF id (ORG/NAME), looked up in the local cache


@dataclass(frozen=True)
class KnownTemplate:
    """One template: its name, who ships it (a plugin's name, or ``deploy``) and its file."""

    name: str
    source: str
    path: Path


def known_templates() -> list[KnownTemplate]:
    """Plugins' templates, then deploy/'s; a file reached twice (deploy/ links to a plugin's) is listed once."""
    from dgpp.plugins import answers_by_plugin, manager

    found: list[KnownTemplate] = []
    for plugin, paths in answers_by_plugin(manager(), "dgpp_deploy_templates"):
        found += [KnownTemplate(Path(p).stem, plugin, Path(p)) for p in paths or []]
    root = deploy_dir()
    if root is not None:
        found += [KnownTemplate(p.stem, "deploy", p) for p in sorted(root.glob("*.json"))]
    seen: set[Path] = set()
    unique = []
    for tpl in found:
        real = tpl.path.resolve()
        if real not in seen:
            seen.add(real)
            unique.append(tpl)
    return unique


def find_template(name: str) -> Path:
    """The file of the template called ``name`` (a ConfigError listing the known names when there is none)."""
    known = known_templates()
    matches = [t for t in known if t.name == name]
    if len(matches) > 1:
        shippers = ", ".join(f"{t.source} ({t.path})" for t in matches)
        raise ConfigError(f"template {name!r} is shipped twice: {shippers}; give the file's path instead")
    if not matches:
        names = ", ".join(sorted(t.name for t in known)) or "none (install a family plugin, e.g. dgpp-qwen)"
        raise ConfigError(
            f"{name!r} is neither a file, a checkpoint directory, nor a known template (templates: {names})"
        )
    return matches[0].path


def write_template_copy(name: str, dest: str | Path | None = None) -> Path:
    """Copy template ``name`` to ``dest`` (a file, or a directory to put ``NAME.json`` in; default: here)."""
    source = find_template(name)
    target = Path(dest).expanduser() if dest is not None else Path(f"{name}.json")
    if target.is_dir():
        target = target / f"{name}.json"
    if target.exists():
        raise ConfigError(f"{target} already exists; choose another path or remove it first")
    if not target.parent.is_dir():
        raise ConfigError(f"{target.parent}: no such directory")
    shutil.copyfile(source, target)
    return target


def model_deployment(model: str, knobs: dict[str, Any]) -> DeployConfig:
    """The world-1 deployment of ``model`` with defaults and knobs (kv_capacity as given or the default)."""
    from dgpp.config import apply_knobs

    return parse_config(apply_knobs({"model": model, "world_size": 1}, knobs), source=f"model {model}")


def context_cap(cfg: DeployConfig, hf_config: dict[str, Any]) -> int:
    """Tokens that fill every slot's context: more pool than that is never used."""
    text = hf_config.get("text_config") or {}
    positions = text.get("max_position_embeddings") or hf_config.get("max_position_embeddings")
    if not positions:
        return MAX_KV_CAPACITY
    return min(MAX_KV_CAPACITY, int(positions) * cfg.engine.max_concurrency)


def sized_kv_capacity(
    cfg: DeployConfig,
    fraction: float,
    device: str | None = None,
    headroom: int | None = None,
    free_bytes: int | None = None,
) -> int:
    """The KV pool (tokens, a multiple of ``block_size``) that the free memory allows (see the module text)."""
    from dgpp.preflight import preflight

    found = preflight(cfg, device=device, headroom=headroom, free_bytes=free_bytes)
    budget = min(int(found.free_bytes * fraction), found.free_bytes - found.headroom)
    block = cfg.engine.block_size
    tokens = min(found.plan.max_kv_capacity(budget, 0, block), context_cap(cfg, found.hf_config))
    tokens -= tokens % block
    if tokens < block:
        raise DgppError(
            f"{found.refusal(block)} (the KV pool was sized from {fraction:g} of free memory: "
            f"give --kv-capacity or --memory-fraction)"
        )
    return tokens


def resolve_target(
    arg: str,
    knobs: dict[str, Any],
    memory_fraction: float | None = None,
    *,
    device: str | None = None,
    headroom: int | None = None,
    free_bytes: int | None = None,
) -> tuple[DeployConfig, Target]:
    """The validated deployment for a ``CONFIG`` argument, with the KV pool sized for a bare model."""
    target = classify(arg)
    if target.template is not None:
        if memory_fraction is not None:
            raise ConfigError(
                "--memory-fraction sizes the KV pool of a model given by path or id; "
                f"{target.label} is a template: set engine.kv_capacity or --kv-capacity"
            )
        return load_config(target.template, knobs), target
    fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    if not 0 < fraction <= 1:
        raise ConfigError(f"--memory-fraction {fraction:g}: must be in (0, 1]")
    cfg = model_deployment(arg, knobs)
    if "kv_capacity" not in knobs:
        tokens = sized_kv_capacity(cfg, fraction, device, headroom, free_bytes)
        cfg = model_deployment(arg, {**knobs, "kv_capacity": tokens})
    return cfg, target
