"""The example plugin is a template an outside author can take away: copied out of the repository, its package
renamed, installed into a fresh venv beside dgpp-core's wheel (offline: no index, no build isolation), it is
found by ``dgpp plugins`` and passes its own tests there (the conformance kit against transformers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest
from build_dists import dependency_closure, link_dependencies

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "dgpp-example-plugin"
# what building and testing the copy needs beside dgpp-core's own dependencies
TOOLS = ["setuptools", "wheel", "pytest", "transformers", "safetensors", "triton"]


def renamed_copy(dest: Path) -> Path:
    """The example under ``dest`` with its package and distribution renamed (``dgpp_llama`` -> ``acme_llama``)."""
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    (dest / "src" / "dgpp_llama").rename(dest / "src" / "acme_llama")
    for path in dest.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".toml", ".md"):
            text = path.read_text()
            path.write_text(text.replace("dgpp_llama", "acme_llama").replace("dgpp-llama", "acme-llama"))
    return dest


def test_a_renamed_copy_installs_offline_and_passes_its_tests(tmp_path):
    wheels, core = tmp_path / "wheels", tmp_path / "dgpp-core"
    # built from a copy, so the build leaves nothing in the repository
    shutil.copytree(
        REPO / "dgpp-core", core, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build")
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(core),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    plugin = renamed_copy(tmp_path / "acme-llama")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    site = next(venv.glob("lib/python*/site-packages"))
    # the third-party packages come from this environment, linked in, so nothing is downloaded
    core_requires = [r for r in distribution("dgpp-core").requires or [] if "extra ==" not in r]
    link_dependencies(dependency_closure([*core_requires, *TOOLS]), venv / "deps")
    (site / "deps.pth").write_text(str(venv / "deps") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT", "VIRTUAL_ENV")}
    python = str(venv / "bin" / "python")
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "-q",
            "--no-index",
            "--no-build-isolation",
            "--find-links",
            str(wheels),
            "dgpp-core",
            str(plugin),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr

    where = subprocess.run(
        [python, "-c", "import acme_llama, dgpp; print(acme_llama.__file__, dgpp.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert all(str(venv) in path for path in where.stdout.split()), where.stdout
    listed = subprocess.run(
        [python, "-m", "dgpp.cli", "plugins"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert listed.returncode == 0 and "acme-llama" in listed.stdout, listed.stdout + listed.stderr

    tests = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        env=env,
        cwd=plugin,
        timeout=1200,
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "skipped" not in tests.stdout, tests.stdout[-2000:]
