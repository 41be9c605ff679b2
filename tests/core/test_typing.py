"""The typing gate: mypy --strict over the plugin contract (``dgpp.plugin_api``, ``dgpp.hookspecs`` and the types
they gather; the list is ``[tool.mypy] files`` in pyproject.toml) reports nothing, and it is strict enough that a
plugin class with a wrong hook signature, or a ``LoadContext`` given a wrong device, fails it.

mypy runs in a subprocess from the repository root (its config and ``.mypy_cache`` live there): the first run reads
torch's annotations (about 30 s on 2 cores), later ones reuse the cache (about 2 s)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mypy", reason="mypy is a test tool (requirements-dev.txt)")


def mypy(*files: str) -> subprocess.CompletedProcess[str]:
    """mypy with the repository's gate configuration; ``files`` replace the configured ones when given."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *files],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )


def test_the_plugin_contract_passes_mypy_strict():
    out = mypy()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found in" in out.stdout


PLUGIN = textwrap.dedent(
    """
    from __future__ import annotations

    from pathlib import Path

    from dgpp.plugin_api import FamilySpec, LoadContext, Model, PluginHooks, TinyCheckpoint, hookimpl


    class RightHooks(PluginHooks):
        @hookimpl
        def dgpp_families(self) -> list[FamilySpec]:
            return []

        @hookimpl
        def dgpp_load_model(self, ctx: LoadContext) -> Model | None:
            return None

        @hookimpl
        def dgpp_tiny_checkpoints(self) -> list[TinyCheckpoint]:
            return []


    class WrongHooks(PluginHooks):
        @hookimpl
        def dgpp_load_model(self, ctx: str) -> Model | None:  # WRONG: argument
            return None

        @hookimpl
        def dgpp_families(self) -> list[str]:  # WRONG: return
            return []

        @hookimpl
        def dgpp_tool_dialect(self, family: str) -> None:  # WRONG: arguments missing
            return None


    CONTEXT = LoadContext(Path(), {}, "toy", "ToyForCausalLM", device=3)  # WRONG: device
    """
)


def test_a_wrong_hook_signature_fails_the_gate(tmp_path):
    source = tmp_path / "toy_plugin.py"
    source.write_text(PLUGIN)
    out = mypy(str(source))
    assert out.returncode == 1, out.stdout + out.stderr
    wrong = {n: line.rsplit("# WRONG: ", 1)[1] for n, line in enumerate(PLUGIN.splitlines(), 1) if "# WRONG" in line}
    errors = {int(m.group(1)): m.group(2) for m in re.finditer(r"toy_plugin\.py:(\d+): error: .*\[([a-z-]+)\]$", out.stdout, re.M)}
    assert errors.keys() == wrong.keys(), out.stdout  # each wrong line, and nothing in RightHooks
    codes = {what: errors[n] for n, what in wrong.items()}
    assert codes == {"argument": "override", "return": "override", "arguments missing": "override",
                     "device": "arg-type"}, out.stdout
    assert out.stdout.count('incompatible with supertype "dgpp.hookspecs.PluginHooks"') == 2, out.stdout
