"""The example third-party plugin (examples/dgpp-example-plugin, distribution dgpp-llama), installed by
scripts/setup.sh like the in-tree families: seen by ``dgpp plugins``, checked by ``dgpp check``, and
written against dgpp's public plugin API only (no in-tree family imported, no private name)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "examples" / "dgpp-example-plugin" / "src" / "dgpp_llama"
DIST = "dgpp-llama"

pytest.importorskip("dgpp_llama", reason="the example plugin is installed by scripts/setup.sh")


def test_dgpp_plugins_lists_the_llama_family():
    out = subprocess.run(
        [sys.executable, "-m", "dgpp.cli", "plugins", "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    report = {rec["name"]: rec for rec in json.loads(out.stdout)}
    llama = report["llama"]
    assert DIST in llama["distribution"]
    family = llama["families"][0]
    assert family["name"] == "llama" and "LlamaForCausalLM" in family["implemented"]


def test_the_plugin_imports_only_dgpp_core_public_modules():
    """A third-party plugin imports dgpp (never an in-tree family) and no underscore names of it."""
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                root = node.module.split(".")[0]
                assert root in {
                    "__future__",
                    "dgpp",
                    "dgpp_llama",
                    "torch",
                    "typing",
                    "dataclasses",
                    "json",
                    "math",
                    "pathlib",
                    "collections",
                }, f"{path.name}: {node.module}"
                if root == "dgpp":
                    assert not any(a.name.startswith("_") for a in node.names), f"{path.name}: {node.module}"
                    assert not any(part.startswith("_") for part in node.module.split(".")), node.module


def test_dgpp_check_accepts_a_llama_deployment(tmp_path):
    from dgpp.testing.builders import build_tiny_checkpoint

    build_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    template = tmp_path / "llama.json"
    template.write_text(json.dumps({"model": "./tiny-llama", "engine": {"kv_capacity": 512}}))
    out = subprocess.run(
        [sys.executable, "-m", "dgpp.cli", "check", str(template)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "family       llama (plugin dgpp-llama) for LlamaForCausalLM" in out.stdout
    # generic estimate from config.json: 2 layers x 2 kv heads x (16 + 16) x fp32
    assert "kv 512 B/token x 512" in out.stdout
