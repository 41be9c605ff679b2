"""Every shipped deployment template validates, and the tiny demo template resolves to a loadable checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TEMPLATES = sorted(DEPLOY.glob("*.json"))


def test_templates_exist():
    names = {p.name for p in TEMPLATES}
    assert {"demo_cpu.json", "demo_tiny_cpu.json", "qwen_nvfp4_w1.json"} <= names


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_template_validates(path):
    cfg = load_config(path)
    assert cfg.model and cfg.world >= 1
    assert len(cfg.digest()) == 16


def test_demo_template_builds_its_checkpoint_once_and_deterministically(tmp_path, monkeypatch):
    from dgpp.checkpoint.resolve import resolve_checkpoint
    from dgpp.demo import enable_demo_checkpoints
    from dgpp.startup.loading import load_model

    enable_demo_checkpoints()  # what every entry point does first
    cfg = load_config(DEPLOY / "demo_tiny_cpu.json")
    monkeypatch.setenv("DGPP_DEMO_DIR", str(tmp_path / "a"))
    first = resolve_checkpoint(cfg.model)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in first.iterdir()
    }
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert (
        resolve_checkpoint(cfg.model) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    )
    monkeypatch.setenv("DGPP_DEMO_DIR", str(tmp_path / "b"))
    second = resolve_checkpoint(cfg.model)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    model = load_model(first)
    assert model.info.vocab_size == 512 and model.info.eos_token_ids


def test_every_schema_key_is_documented():
    import msgspec

    from dgpp.config import DeployConfig

    doc = (DEPLOY.parent / "docs" / "configuration.md").read_text()
    missing = []

    def walk(info, prefix):
        for f in info.fields:
            if f"`{f.encode_name}`" not in doc:
                missing.append(prefix + f.encode_name)
            inner = f.type
            if isinstance(inner, msgspec.inspect.UnionType):
                inner = next((t for t in inner.types if not isinstance(t, msgspec.inspect.NoneType)), inner)
            if isinstance(inner, msgspec.inspect.StructType):
                walk(inner, f"{prefix}{f.encode_name}.")

    walk(msgspec.inspect.type_info(DeployConfig), "")
    assert not missing, f"keys missing from docs/configuration.md: {missing}"
