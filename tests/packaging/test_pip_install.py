"""The pip-installed user's path: the wheels of dgpp-core and dgpp-qwen (built from their sdists) in a fresh
venv, run from outside the repository. The plugin is found, its templates are listed and usable by name, a
bare checkpoint directory serves a completion, and the demo without its extra says which extra to install."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from build_dists import fresh_venv
from serve_fixture import Server, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(built_dists, tmp_path_factory):
    where = tmp_path_factory.mktemp("venv") / "env"
    pip = fresh_venv(where, built_dists, ["dgpp-core", "dgpp-qwen"])
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return where / "bin"


@pytest.fixture
def user_env(tmp_path):
    """No repository on the path, an empty HF cache and demo cache, no GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DGPP_DEPLOY_DIR", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_CACHE=str(tmp_path / "hub"), DGPP_DEMO_DIR=str(tmp_path / "demo"), CUDA_VISIBLE_DEVICES=""
    )
    return env


def dgpp(venv: Path, env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "dgpp"), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def test_the_installed_package_is_the_wheel_not_the_repository(venv, user_env, tmp_path):
    out = subprocess.run(
        [str(venv / "python"), "-c", "import dgpp, dgpp_qwen; print(dgpp.__file__, dgpp_qwen.__file__)"],
        capture_output=True,
        text=True,
        env=user_env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for path in out.stdout.split():
        assert "site-packages" in path and not path.startswith(str(Path(__file__).parents[2])), path


def test_plugins_lists_qwen_only(venv, user_env, tmp_path):
    out = dgpp(venv, user_env, tmp_path, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    report = {rec["name"]: rec for rec in json.loads(out.stdout)}
    assert set(report) == {"dgpp-core", "qwen"}
    assert "dgpp-qwen 0.1.0" == report["qwen"]["distribution"]
    assert "Qwen3ForCausalLM" in report["qwen"]["families"][0]["implemented"]


def test_templates_lists_the_qwen_templates_shipped_in_the_wheel(venv, user_env, tmp_path):
    out = dgpp(venv, user_env, tmp_path, "templates", "--json")
    assert out.returncode == 0, out.stderr
    report = {rec["name"]: rec for rec in json.loads(out.stdout)}
    qwen = {name for name, rec in report.items() if rec["source"] == "qwen"}
    assert qwen == {"qwen_nvfp4_w1", "qwen3.5-122b-a10b_nvfp4_w2", "qwen3.8-flash-next_nvfp4-radixark_w1"}
    assert all(rec["valid"] and "site-packages" in rec["path"] for rec in report.values())

    written = dgpp(venv, user_env, tmp_path, "templates", "--write", "qwen_nvfp4_w1", "mine.json")
    assert written.returncode == 0, written.stderr
    assert json.loads((tmp_path / "mine.json").read_text())["model"] == "nvidia/Qwen3.5-122B-A10B-NVFP4"


def test_check_by_template_name_asks_to_fetch_the_checkpoint(venv, user_env, tmp_path):
    out = dgpp(venv, user_env, tmp_path, "check", "qwen_nvfp4_w1")
    assert out.returncode == 1
    err = out.stderr.strip()
    assert "checkpoint 'nvidia/Qwen3.5-122B-A10B-NVFP4' not found" in err and "fetch it first" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_demo_without_its_extra_names_the_extra(venv, user_env, tmp_path):
    out = dgpp(venv, user_env, tmp_path, "serve", "demo_cpu")
    assert out.returncode == 1
    err = out.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "which is not installed: pip install 'dgpp-core[demo]'" in err  # transformers today


@pytest.mark.e2e
def test_serve_a_checkpoint_directory_answers_a_completion(venv, user_env, tmp_path):
    from dgpp.testing.builders import build_tiny_checkpoint
    from dgpp.testing.tokenizers import build_tiny_tokenizer

    ckpt = tmp_path / "tiny-qwen3"
    build_tiny_tokenizer(ckpt)
    build_tiny_checkpoint("qwen3", ckpt, seed=5)
    check = dgpp(venv, user_env, tmp_path, "check", "tiny-qwen3")
    assert check.returncode == 0, check.stderr
    assert "engine.kv_capacity 4096 (sized to the free memory)" in check.stdout  # 8 slots x 512 positions

    port = free_port()
    cmd = [str(venv / "dgpp"), "serve", "tiny-qwen3", "--port", str(port)]
    server = Server.command(cmd, port, tmp_path, env=user_env, cwd=tmp_path)
    try:
        server.wait_ready(timeout=240)
        from openai import OpenAI

        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        [model] = client.models.list().data
        assert model.id == "tiny-qwen3"
        done = client.completions.create(model=model.id, prompt="Hello", max_tokens=4, temperature=0)
        assert 1 <= done.usage.completion_tokens <= 4 and done.choices[0].finish_reason in ("length", "stop")
    finally:
        server.stop()
