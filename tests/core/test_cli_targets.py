"""What ``dgpp serve X`` / ``dgpp check X`` accept: a template file, a shipped template's name, or a model
(checkpoint directory, ``.gguf`` file, HF id) deployed with defaults and a KV pool sized to free memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dgpp.cli import main
from dgpp.cli_target import classify, find_template, known_templates, resolve_target, write_template_copy
from dgpp.deploy_templates import deploy_dir
from dgpp.errors import CheckpointError, ConfigError
from dgpp.step.memory import GiB

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from dgpp.testing.builders import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3", seed=3)


def test_plugins_ship_their_templates_and_deploy_links_to_them():
    by_name = {t.name: t for t in known_templates()}
    assert by_name["qwen_nvfp4_w1"].source == "qwen" and by_name["glm-4.7_nvfp4_w4"].source == "glm"
    assert by_name["demo_cpu"].source == "dgpp-core"
    for tpl in by_name.values():  # listed once, from the package that ships it
        assert tpl.path.resolve().is_relative_to(REPO / "plugins") or tpl.name in (
            "demo_cpu",
            "demo_tiny_cpu",
        ), tpl
    for link in deploy_dir().glob("*.json"):
        assert link.resolve() in {t.path.resolve() for t in by_name.values()}, link
    assert find_template("qwen_nvfp4_w1").parent.name == "templates"


def test_a_name_that_is_no_template_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"'qwen_nvfp4' is neither a file.*known template.*qwen_nvfp4_w1"):
        find_template("qwen_nvfp4")


def test_templates_write_copies_a_template_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["templates", "--write", "qwen_nvfp4_w1"]) == 0
    assert "wrote qwen_nvfp4_w1.json" in capsys.readouterr().out
    assert (tmp_path / "qwen_nvfp4_w1.json").read_bytes() == find_template("qwen_nvfp4_w1").read_bytes()
    (tmp_path / "sub").mkdir()
    assert (
        write_template_copy("glm-4.7_nvfp4_w4", tmp_path / "sub")
        == tmp_path / "sub" / "glm-4.7_nvfp4_w4.json"
    )
    assert main(["templates", "--write", "qwen_nvfp4_w1"]) == 1
    assert "qwen_nvfp4_w1.json already exists" in capsys.readouterr().err


def test_the_argument_kinds(tmp_path, tiny_qwen3, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert classify(str(tiny_qwen3)).model == str(tiny_qwen3)
    assert classify("m.gguf").model == "m.gguf"
    assert classify("org/name").model == "org/name"  # an HF id
    assert classify("qwen_nvfp4_w1").template == find_template("qwen_nvfp4_w1")
    assert classify("absent.json").template == Path("absent.json")  # read (and refused) as a template


def test_a_broken_gguf_file_is_refused_naming_it(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # the magic and nothing else
    assert main(["check", str(gguf)]) == 1
    err = capsys.readouterr().err
    assert f"{gguf}: cannot read as GGUF" in err and "Traceback" not in err
    with pytest.raises(CheckpointError, match="not found"):  # a missing .gguf: the loader's own message
        resolve_target(str(tmp_path / "absent.gguf"), {})


def test_a_checkpoint_directory_gets_a_kv_pool_sized_to_the_free_memory(tiny_qwen3):
    from dgpp.preflight import preflight

    def sized(free: int, headroom: int, fraction: float) -> int:
        cfg, target = resolve_target(str(tiny_qwen3), {}, fraction, free_bytes=free, headroom=headroom)
        assert target.model == str(tiny_qwen3) and cfg.world == 1
        plan = preflight(cfg, free_bytes=free, headroom=headroom).plan
        rest = plan.total() - plan.kv_per_token * plan.kv_capacity
        budget = min(int(free * fraction), free - headroom)
        assert cfg.engine.kv_capacity == (budget - rest) // plan.kv_per_token // 16 * 16
        return cfg.engine.kv_capacity

    # what the plan needs besides the pool, then budgets 1 MiB past it: the headroom binds (it leaves less than
    # 0.95 x free), then the fraction does (half of twice that); neither reaches the cap of 8 x 512 tokens
    probe, _ = resolve_target(str(tiny_qwen3), {"kv_capacity": 16})
    plan = preflight(probe, free_bytes=GiB, headroom=0).plan
    rest = plan.total() - plan.kv_per_token * plan.kv_capacity
    by_headroom = sized(GiB + rest + (1 << 20), GiB, 0.95)
    by_fraction = sized(2 * (rest + (1 << 19)), 0, 0.5)
    assert 16 <= by_fraction < by_headroom < 8 * 512

    roomy, _ = resolve_target(str(tiny_qwen3), {"max_concurrency": 2}, free_bytes=64 * GiB)
    assert roomy.engine.kv_capacity == 2 * 512  # capped: two slots of max_position_embeddings each
    given, _ = resolve_target(str(tiny_qwen3), {"kv_capacity": 100}, free_bytes=GiB, headroom=0)
    assert given.engine.kv_capacity == 100


def test_a_model_that_leaves_no_room_for_a_pool_is_refused_naming_the_knobs(tiny_qwen3, capsys):
    assert main(["check", str(tiny_qwen3), "--free-gib", "1", "--headroom-gib", "1"]) == 1
    err = capsys.readouterr().err
    assert "memory plan does not fit" in err and "give --kv-capacity or --memory-fraction" in err


def test_check_a_model_prints_the_sized_deployment(tiny_qwen3, capsys):
    assert main(["check", str(tiny_qwen3), "--free-gib", "64", "--memory-fraction", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "engine.kv_capacity 4096 (sized to the free memory)" in out and out.rstrip().endswith("ready")


def test_memory_fraction_is_for_models_only_and_in_range(tmp_path, tiny_qwen3, capsys):
    template = tmp_path / "t.json"
    template.write_text(json.dumps({"model": str(tiny_qwen3)}))
    assert main(["check", str(template), "--memory-fraction", "0.5"]) == 1
    assert "--memory-fraction sizes the KV pool of a model" in capsys.readouterr().err
    assert main(["check", str(tiny_qwen3), "--memory-fraction", "1.5"]) == 1
    assert "--memory-fraction 1.5: must be in (0, 1]" in capsys.readouterr().err


def test_an_hf_id_in_the_local_cache_is_a_model(tmp_path, tiny_qwen3, monkeypatch, capsys):
    repo = tmp_path / "hub" / "models--org--tiny-qwen3"
    shutil.copytree(tiny_qwen3, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "org/tiny-qwen3", "--free-gib", "64", "--max-concurrency", "2"]) == 0
    out = capsys.readouterr().out
    assert "engine.kv_capacity 1024 (sized to the free memory)" in out  # 2 slots x 512 positions
    assert "checkpoint   org/tiny-qwen3 -> " in out and "snapshots/abc123" in out
