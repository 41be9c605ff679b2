"""Deployment templates by name: the ones plugins ship in their wheels and the repository's ``deploy/``.

A family plugin keeps its releases' templates in a ``templates/`` folder inside its package (package
data, so a plain ``pip install`` carries them) and returns them from ``dgpp_deploy_templates``
(``packaged_templates(__name__)``). A template's name is its file name without ``.json``; ``dgpp serve
NAME``, ``dgpp check NAME`` and ``dgpp templates --write NAME`` look names up here.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from dgpp.errors import ConfigError

TEMPLATE_DIR = "templates"  # the package-data folder a plugin ships its templates in


@dataclass(frozen=True)
class KnownTemplate:
    """One template: its name, who ships it (a plugin's name, or ``deploy``) and its file."""

    name: str
    source: str
    path: Path


def packaged_templates(module: str) -> list[Path]:
    """The ``*.json`` files in the ``templates/`` folder of ``module``'s package (a plugin's hook answer)."""
    package = module.rpartition(".")[0] or module
    folder = files(package) / TEMPLATE_DIR
    if not folder.is_dir():
        return []
    return sorted(Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith(".json"))


def deploy_dir() -> Path | None:
    """The repository's deploy/ (``$DGPP_DEPLOY_DIR`` overrides); None when dgpp is installed without it."""
    if os.environ.get("DGPP_DEPLOY_DIR"):
        return Path(os.environ["DGPP_DEPLOY_DIR"]).expanduser()
    import dgpp

    repo_deploy = Path(dgpp.__file__).resolve().parents[3] / "deploy"  # dgpp-core/src/dgpp -> repo root
    return repo_deploy if repo_deploy.is_dir() else None


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
