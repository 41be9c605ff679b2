"""Every distribution is publishable: ``python -m build`` makes an sdist and a wheel built from it, both pass
``twine check --strict`` (the README renders as the long description), and each carries its license, the
one version its package states, its ``py.typed`` marker, and (plugins) the templates of its releases."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from build_dists import DIST_DIRS, REPO

pytestmark = pytest.mark.slow


def project_name(project: Path) -> str:
    return re.search(r'^name = "([^"]+)"', (project / "pyproject.toml").read_text(), re.M).group(1)


def package_version(project: Path) -> str:
    init = next((project / "src").glob("*/__init__.py"))
    return re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M).group(1)


def built(out: Path, project: Path) -> tuple[Path, Path]:
    stem = f"{project_name(project).replace('-', '_')}-{package_version(project)}"
    return out / f"{stem}.tar.gz", out / f"{stem}-py3-none-any.whl"


def test_every_distribution_builds_an_sdist_and_a_wheel_that_twine_accepts(built_dists):
    files = [f for project in DIST_DIRS for f in built(built_dists, project)]
    assert all(f.is_file() for f in files), sorted(p.name for p in built_dists.iterdir())
    out = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASSED") == len(files)


@pytest.mark.parametrize("project", DIST_DIRS, ids=lambda p: p.name)
def test_metadata_license_and_package_data(built_dists, project):
    sdist, wheel = built(built_dists, project)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = Parser().parsestr(
            zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        )
        license_text = zf.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
    assert license_text == (REPO / "LICENSE").read_text()
    assert meta["License-Expression"] == "Apache-2.0" and meta["Version"] == package_version(project)
    assert meta["Description-Content-Type"] == "text/markdown" and meta.get_payload().startswith(
        f"# {meta['Name']}"
    )
    assert meta.get_all("Classifier") and any(
        u.startswith("Source, https://") for u in meta.get_all("Project-URL")
    )
    package = next((project / "src").glob("*/__init__.py")).parent.name
    assert f"{package}/py.typed" in names  # type checkers read the package's annotations (PEP 561)
    shipped = sorted(p.name for p in (project / "src").glob("*/templates/*.json"))
    in_wheel = sorted(Path(n).name for n in names if re.match(r"[^/]+/templates/[^/]+\.json$", n))
    assert in_wheel == shipped
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1]: m for m in tf.getmembers() if "/" in m.name}
    assert members["LICENSE"].isfile() and members["README.md"].isfile()
    for name in shipped:  # a template that is a link in the repository is a plain file in the sdist
        assert any(path.endswith(f"templates/{name}") and m.isfile() for path, m in members.items()), name
