"""The typing gate: mypy --strict over the plugin contract (``dgpp.plugin_api``, ``dgpp.hookspecs`` and the types
they gather) and every plugin package and the example (the list is ``[tool.mypy] files`` in pyproject.toml) reports
nothing; it is strict enough that a plugin class with a wrong hook signature, a ``LoadContext`` given a wrong
device, or a family whose referenced config class, model class, drafter, hook or offer has another signature than
core calls it with, fails it.

mypy runs in a subprocess from the repository root (its config and ``.mypy_cache`` live there): a cold run over the
78 files takes about 11 s on 2 cores, later ones reuse the cache (about 1 s each)."""

from __future__ import annotations

import os
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
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
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
    wrong = {
        n: line.rsplit("# WRONG: ", 1)[1]
        for n, line in enumerate(PLUGIN.splitlines(), 1)
        if "# WRONG" in line
    }
    errors = {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r"toy_plugin\.py:(\d+): error: .*\[([a-z-]+)\]$", out.stdout, re.M)
    }
    assert errors.keys() == wrong.keys(), out.stdout  # each wrong line, and nothing in RightHooks
    codes = {what: errors[n] for n, what in wrong.items()}
    assert codes == {
        "argument": "override",
        "return": "override",
        "arguments missing": "override",
        "device": "arg-type",
    }, out.stdout
    assert out.stdout.count('incompatible with supertype "dgpp.hookspecs.PluginHooks"') == 2, out.stdout


# What core calls each reference of a family's declaration as (dgpp.family_contract, dgpp.startup.assembly)
REFERENCE_TYPES = textwrap.dedent(
    """
    from __future__ import annotations

    from collections.abc import Callable
    from typing import Any, Protocol

    import torch

    from dgpp.family import FamilyConfig
    from dgpp.plugin_api import (
        BenchGeometry, BlockDrafter, Dialect, Drafter, GGUFArchitecture, LoadContext, MemoryPlan, Model, ModelMemory,
        TinyCheckpoint, World,
    )


    class ModelClass(Protocol):
        def __call__(self, cfg: Any, *, dtype: torch.dtype, world: World, group: Any) -> Model: ...
    """
)
FAMILY_REFERENCES = {
    "dialect": "Callable[[dict[str, Any]], Dialect]",
    "chat_template": "Callable[[dict[str, Any]], str]",
    "tiny_checkpoints": "Callable[[], list[TinyCheckpoint]]",
    "bench_geometries": "Callable[[], list[BenchGeometry]]",
    "gguf_architectures": "Callable[[], list[GGUFArchitecture]]",
}
MODEL_TYPES = {
    "config": "type[FamilyConfig]",
    "model": "ModelClass",
    "renames": "Callable[[str], str]",
    "drafter": "Callable[[LoadContext, Any], Drafter | BlockDrafter | None]",
    "load_model": "Callable[[LoadContext], Model]",
    "memory_plan": "Callable[[LoadContext], ModelMemory | MemoryPlan]",
}


def reference_checks(families: list) -> str:
    """A module that binds every ``"module:name"`` reference of ``families`` to the type core calls it as, so
    mypy holds each config class, model class, drafter, hook and offer to its contract."""
    head, body = [REFERENCE_TYPES], []
    for family in families:
        refs = [
            (f"{family.name}.{key}", FAMILY_REFERENCES[key], getattr(family, key))
            for key in FAMILY_REFERENCES
            if getattr(family, key)
        ]
        for i, model in enumerate(family.models):
            refs += [
                (f"{family.name}.models[{i}].{key}", MODEL_TYPES[key], getattr(model, key))
                for key in ("config", "model", "renames", "drafter")
                if getattr(model, key)
            ]
            refs += [
                (f"{family.name}.models[{i}].hooks[{key}]", MODEL_TYPES[key], ref)
                for key, ref in model.hooks.items()
            ]
        for where, kind, ref in refs:
            module, name = ref.split(":")
            n = len(body)
            head.append(f"from {module} import {name} as _ref{n}")
            body.append(f"_bound{n}: {kind} = _ref{n}  # {where}")
    return "\n".join(head + ["", ""] + body) + "\n"


def installed_families() -> list:
    from dgpp.plugins import installed_entry_points

    return [ep.load() for _, ep in sorted(installed_entry_points().items())]


def test_every_family_reference_has_the_type_core_calls_it_as(tmp_path):
    families = installed_families()
    assert {f.name for f in families} >= {"deepseek", "flint", "glm", "llama", "mimo", "qwen"}
    source = tmp_path / "family_references.py"
    source.write_text(reference_checks(families))
    out = mypy(str(source))
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_wrong_reference_signature_fails_the_gate(tmp_path):
    """A config class whose ``from_hf_config`` takes a path, and a model class built without ``dtype``."""
    (tmp_path / "toy_family.py").write_text(
        textwrap.dedent(
            """
        from __future__ import annotations

        from dataclasses import dataclass
        from pathlib import Path

        import torch

        from dgpp.plugin_api import Model, World


        @dataclass(frozen=True)
        class ToyConfig:
            dtype: torch.dtype

            @classmethod
            def from_hf_config(cls, path: Path) -> ToyConfig:
                return cls(torch.float32)


        class ToyModel(Model):
            def __init__(self, cfg: ToyConfig, *, world: World) -> None:
                super().__init__()
        """
        )
    )
    from dgpp.plugin_api import Family, FamilyModel

    toy = Family(
        name="toy",
        plugin="toy",
        architectures=("ToyForCausalLM",),
        models=(
            FamilyModel(
                claims=("ToyForCausalLM",), config="toy_family:ToyConfig", model="toy_family:ToyModel"
            ),
        ),
    )
    source = tmp_path / "toy_references.py"
    source.write_text(reference_checks([toy]))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(source)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MYPYPATH": str(tmp_path)},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    flagged = {
        m.group(1)
        for m in re.finditer(r"# (toy\.\S+)$", source.read_text(), re.M)
        if any(
            f"toy_references.py:{n}:" in out.stdout
            for n, line in enumerate(source.read_text().splitlines(), 1)
            if m.group(1) in line
        )
    }
    assert flagged == {"toy.models[0].config", "toy.models[0].model"}, out.stdout
