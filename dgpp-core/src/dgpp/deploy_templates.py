"""Deployment templates by name: the ones plugins ship in their wheels and the repository's ``deploy/``.

A family plugin keeps its releases' templates in a ``templates/`` folder inside its package (package
data, so a plain ``pip install`` carries them) and returns them from ``dgpp_deploy_templates``
(``packaged_templates(__name__)``). A template's name is its file name without ``.json``; ``dgpp serve
NAME``, ``dgpp check NAME`` and ``dgpp templates --write NAME`` look names up (``dgpp.cli_target``).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

TEMPLATE_DIR = "templates"  # the package-data folder a plugin ships its templates in


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
