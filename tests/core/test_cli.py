"""The ``dgpp`` command: exit codes of ``check`` (subprocess), knobs, ``serve``'s hand-off, listings."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from dgpp.cli import main


def run_dgpp(*args: str, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "dgpp.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from dgpp.testing.builders import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3", seed=3)


def write_template(tmp_path, name: str, **raw) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


def test_version():
    out = run_dgpp("--version")
    assert out.returncode == 0 and out.stdout.startswith("dgpp 0.1.0")


def test_check_ready_exits_0_and_prints_the_plan(tmp_path, tiny_qwen3):
    cfg = write_template(tmp_path, "ok.json", model=str(tiny_qwen3), engine={"kv_capacity": 2048})
    out = run_dgpp("check", cfg, "--kv-capacity", "1024", "--free-gib", "64", "--headroom-gib", "1")
    assert out.returncode == 0, out.stderr
    assert "family       qwen (plugin dgpp-qwen) for Qwen3ForCausalLM" in out.stdout
    assert "kv_pool" in out.stdout and "x 1024" in out.stdout  # the knob reached the plan
    assert out.stdout.rstrip().endswith("ready")


def test_check_refusals_exit_1_with_the_reason(tmp_path, tiny_qwen3):
    bad_key = write_template(tmp_path, "bad.json", model=str(tiny_qwen3), engine={"max_concurency": 2})
    out = run_dgpp("check", bad_key)
    assert out.returncode == 1 and "engine.max_concurency: unknown key" in out.stderr

    missing = write_template(tmp_path, "missing.json", model="org/absent-model")
    out = run_dgpp("check", missing, env_extra={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert out.returncode == 1 and "checkpoint 'org/absent-model' not found" in out.stderr
    assert str(tmp_path / "hub") in out.stderr


def test_check_refuses_unsupported_models_and_plans_that_do_not_fit(tmp_path, tiny_qwen3, capsys):
    # in-process (same code path as the subprocess runs above, without another interpreter start)
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(
        json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"})
    )
    assert main(["check", write_template(tmp_path, "u.json", model=str(unsupported))]) == 1
    assert "no installed plugin claims" in capsys.readouterr().err

    too_big = write_template(tmp_path, "big.json", model=str(tiny_qwen3), engine={"kv_capacity": 1 << 30})
    assert main(["check", too_big, "--free-gib", "8", "--headroom-gib", "4"]) == 1
    err = capsys.readouterr().err
    assert "memory plan does not fit" in err and "largest engine.kv_capacity that fits" in err


def test_topology_flags_are_refused_as_knobs(tmp_path, capsys):
    cfg = write_template(tmp_path, "t.json", model="m")
    for flag in ("--model", "--world-size", "--nodes"):
        with pytest.raises(SystemExit) as exc:
            main(["check", cfg, flag, "x"])
        assert exc.value.code == 2
        assert f"{flag} is not a knob" in capsys.readouterr().err


def test_serve_hands_the_validated_config_with_knobs_to_the_server(tmp_path, tiny_qwen3, monkeypatch):
    seen = {}
    assembly = types.ModuleType("dgpp.server_assembly")
    assembly.serve_deployment = lambda cfg, **_: seen.setdefault("cfg", cfg) and None
    monkeypatch.setitem(sys.modules, "dgpp.server_assembly", assembly)
    cfg = write_template(tmp_path, "s.json", model=str(tiny_qwen3), engine={"mtp": True, "mtp_depth": 2})
    assert (
        main(["serve", cfg, "--no-mtp", "--knobs", "--kv-capacity 4096 --mtp-depth 3", "--port", "9001"]) == 0
    )
    got = seen["cfg"]
    assert (got.engine.mtp, got.engine.mtp_depth, got.engine.kv_capacity, got.http.port) == (
        False,
        3,
        4096,
        9001,
    )


def test_the_compute_dtype_is_a_knob(tmp_path, tiny_qwen3, monkeypatch, capsys):
    seen = {}
    assembly = types.ModuleType("dgpp.server_assembly")
    assembly.serve_deployment = lambda cfg, **_: seen.setdefault("cfg", cfg) and None
    monkeypatch.setitem(sys.modules, "dgpp.server_assembly", assembly)
    cfg = write_template(tmp_path, "s.json", model=str(tiny_qwen3))
    assert main(["serve", cfg, "--dtype", "bfloat16"]) == 0
    assert seen["cfg"].engine.dtype == "bfloat16"
    assert main(["serve", cfg, "--dtype", "bf17"]) == 1
    assert "engine.dtype" in capsys.readouterr().err


def test_serve_refuses_a_plan_that_does_not_fit_before_loading(tmp_path, tiny_qwen3, monkeypatch, capsys):
    assembly = types.ModuleType("dgpp.server_assembly")
    assembly.serve_deployment = lambda cfg, **_: pytest.fail("serve_deployment() must not be reached")
    monkeypatch.setitem(sys.modules, "dgpp.server_assembly", assembly)
    cfg = write_template(tmp_path, "s.json", model=str(tiny_qwen3), engine={"kv_capacity": 1 << 40})
    assert main(["serve", cfg]) == 1
    assert "memory plan does not fit" in capsys.readouterr().err


def test_bad_template_in_process_exits_1(tmp_path, capsys):
    cfg = write_template(tmp_path, "s.json", model="m", engine={"kv_capacity": -5})
    assert main(["serve", cfg]) == 1
    assert "engine.kv_capacity: out of range" in capsys.readouterr().err


def test_plugins_lists_families_and_quant_formats(capsys):
    assert main(["plugins", "--json"]) == 0
    report = {rec["name"]: rec for rec in json.loads(capsys.readouterr().out)}
    assert {"dgpp-core", "qwen", "glm", "deepseek", "mimo", "flint"} <= set(report)
    qwen = report["qwen"]["families"][0]
    assert "Qwen3ForCausalLM" in qwen["implemented"] and "dgpp-qwen" in report["qwen"]["distribution"]
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "family qwen" in text and "claimed, not yet supported" in text


def test_templates_lists_the_deploy_directory(capsys):
    assert main(["templates", "--json"]) == 0
    report = {rec["name"]: rec for rec in json.loads(capsys.readouterr().out)}
    assert report["demo_tiny_cpu"]["valid"] and report["demo_tiny_cpu"]["model"] == "dgpp-demo/qwen3-tiny"
    assert report["demo_cpu"]["valid"] and report["demo_cpu"]["model"] == "dgpp-demo/smollm2-135m-instruct"
    assert report["qwen_nvfp4_w1"]["model"] == "nvidia/Qwen3.5-122B-A10B-NVFP4"


def test_templates_reports_an_invalid_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DGPP_DEPLOY_DIR", str(tmp_path))
    write_template(tmp_path, "good.json", model="m")
    write_template(tmp_path, "bad.json", model="m", engine={"nope": 1})
    assert main(["templates"]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "engine.nope: unknown key" in out and "good" in out


def test_check_refuses_a_kv_format_serve_would_refuse(tmp_path, tiny_qwen3, capsys):
    # check and serve share the preflight: "ready" from check must mean serve starts
    fp8_kv = write_template(tmp_path, "fp8kv.json", model=str(tiny_qwen3), engine={"kv_dtype": "fp8"})
    assert main(["check", fp8_kv]) == 1
    assert "engine.kv_dtype" in capsys.readouterr().err


def test_check_names_a_load_time_fp8_conversion_as_a_lossy_lever(tmp_path, tiny_qwen3, capsys):
    dense_fp8 = write_template(tmp_path, "d.json", model=str(tiny_qwen3), engine={"dense_weights": "fp8"})
    assert main(["check", dense_fp8]) == 0
    assert "lossy levers dense_weights" in capsys.readouterr().out
