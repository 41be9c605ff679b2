"""The example third-party plugin: pip-installed into this venv, seen by ``dgpp plugins``, loaded and run.

It is installed editable for the duration of this module and uninstalled afterwards; everything that
must see the new entry point runs in a fresh interpreter (entry points are read per process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "dgpp-example-plugin"
DIST = "dgpp-example-plugin"


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def installed():
    out = pip("install", "--no-deps", "--no-build-isolation", "-e", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    try:
        yield
    finally:
        pip("uninstall", "-y", DIST)


def run_py(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_dgpp_plugins_lists_the_toy_family(installed, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dgpp.cli", "plugins", "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    report = {rec["name"]: rec for rec in json.loads(out.stdout)}
    toy = report["toy"]
    assert DIST in toy["distribution"]
    assert toy["families"][0]["name"] == "toy" and "ToyForCausalLM" in toy["families"][0]["implemented"]
    assert toy["templates"] and toy["templates"][0].endswith("toy_cpu.json")


def test_the_toy_model_loads_through_the_plugin_and_matches_its_reference(installed, tmp_path):
    out = run_py(
        """
        import torch
        from dgpp_example.checkpoint import write_toy_checkpoint
        from dgpp.engine.loading import load_model
        from dgpp.step.pools import CachePools
        from dgpp.engine.runner import ModelRunner, SeqWork

        ckpt = write_toy_checkpoint("toy", seed=7)
        model = load_model(ckpt)  # entry point -> dgpp_families -> resolve -> dgpp_load_model
        assert type(model).__name__ == "ToyModel", type(model)
        runner = ModelRunner(model, CachePools(model.cache_spec(), num_blocks=8, block_size=4, num_state_slots=2))
        a, b = [5, 6, 7, 8, 9, 10], [20, 21, 22]
        with torch.no_grad():
            first = runner.step([SeqWork(0, [0, 1], 0, a[:5]), SeqWork(1, [2], 0, b)])  # two prefills
            second = runner.step([SeqWork(0, [0, 1], 5, a[5:]), SeqWork(1, [2], 3, [30])])  # two decodes
            ref_a, ref_b = model.reference_logits(a), model.reference_logits(b + [30])
        for got, want in [(first[0], ref_a[4]), (first[1], ref_b[2]), (second[0], ref_a[5]), (second[1], ref_b[3])]:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        print("OK", tuple(first.shape))
        """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "OK (2, 96)" in out.stdout


def test_dgpp_check_accepts_a_toy_deployment(installed, tmp_path):
    prep = run_py(
        "from dgpp_example.checkpoint import write_toy_checkpoint; write_toy_checkpoint('toy-checkpoint')",
        cwd=tmp_path,
    )
    assert prep.returncode == 0, prep.stderr
    template = tmp_path / "toy.json"
    template.write_text(json.dumps({"model": "./toy-checkpoint", "engine": {"kv_capacity": 512}}))
    out = subprocess.run(
        [sys.executable, "-m", "dgpp.cli", "check", str(template)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "family       toy (plugin dgpp-example-plugin) for ToyForCausalLM" in out.stdout
    assert (
        "kv 512 B/token x 512" in out.stdout
    )  # from the plugin's own plan: 2 layers x 2 heads x (16+16) x fp32
