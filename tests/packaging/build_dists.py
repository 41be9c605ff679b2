"""Build every distribution's sdist, then its wheel from that sdist, and make a fresh venv that sees only
the wheels asked for plus the dependencies they declare.

The venv gets no package index: its third-party dependencies (the declared ``Requires-Dist`` closure of
the installed wheels, torch included) are linked from the test environment into one directory named by a
``.pth`` file, so nothing is downloaded and no other torch can be resolved. Only what the wheels declare
is there: an undeclared import (transformers, say) fails in the venv as it would after ``pip install``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
DIST_DIRS = [
    REPO / "dgpp-core",
    *sorted(p.parent for p in (REPO / "plugins").glob("*/pyproject.toml")),
    *sorted(p.parent for p in (REPO / "examples").glob("*/pyproject.toml")),
]


def build_all(out: Path) -> list[subprocess.CompletedProcess]:
    """``python -m build`` (sdist, then the wheel built from the unpacked sdist) for every distribution.

    ``--no-isolation`` builds with this environment's setuptools instead of fetching one per build.
    """

    def build(project: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(project)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(build, DIST_DIRS))


def _requirements(dist: Distribution, extras: frozenset[str]) -> list[Requirement]:
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def dependency_closure(requirements: list[str]) -> list[Distribution]:
    """The installed distributions that ``requirements`` need, transitively (extras followed)."""
    found: dict[str, Distribution] = {}
    followed: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in followed:
            continue
        followed.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue  # the venv's pip install reports it as unsatisfied
        found[key[0]] = dist
        todo += _requirements(dist, key[1])
    return list(found.values())


def link_dependencies(dists: list[Distribution], target: Path) -> None:
    """Symlink each distribution's top-level modules and its metadata directory into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        site = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            src, dst = site / top, target / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)


def fresh_venv(where: Path, wheels: Path, names: list[str]) -> subprocess.CompletedProcess:
    """A venv at ``where`` with the wheels ``names`` installed (``pip --no-index``); pip's result."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=300)
    site = next(where.glob("lib/python*/site-packages"))
    wheel_meta = [_wheel_requirements(w) for n in names for w in wheels.glob(f"{n.replace('-', '_')}-*.whl")]
    third_party = [r for reqs in wheel_meta for r in reqs if not Requirement(r).name.startswith("dgpp")]
    link_dependencies(dependency_closure(third_party), where / "deps")
    (site / "dgpp_test_deps.pth").write_text(str(where / "deps") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(where / "bin" / "python"),
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheels),
            *names,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _wheel_requirements(wheel: Path) -> list[str]:
    """A wheel's ``Requires-Dist`` lines without extras-only ones."""
    import zipfile
    from email.parser import Parser

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(zf.read(meta).decode())
    reqs = [Requirement(r) for r in headers.get_all("Requires-Dist") or []]
    return [str(r) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
