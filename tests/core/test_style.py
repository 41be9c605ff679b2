"""The style gate: every Python file the repository tracks is as ``ruff format`` writes it and passes ``ruff check``
(the settings are ``[tool.ruff]`` in pyproject.toml), so a change that skips the formatter fails the test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    # ruff is a test tool (requirements-dev.txt), installed beside the interpreter running the tests
    exe = Path(sys.executable).with_name("ruff")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_file_is_formatted():
    out = ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_lint_passes():
    out = ruff("check", ".")
    assert out.returncode == 0, out.stdout + out.stderr
