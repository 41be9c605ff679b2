"""Checkpoint resolution for a template's ``model``: local directory, HF cache layout (offline), the demo."""

from __future__ import annotations

import pytest

from dgpp.checkpoint.resolve import resolve_checkpoint
from dgpp.errors import CheckpointError


def make_checkpoint(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hub"


def test_local_directory(tmp_path, hub):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    assert resolve_checkpoint(str(ckpt)) == ckpt.resolve()
    assert resolve_checkpoint("ckpt") == ckpt.resolve()  # relative to the current directory
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty has no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"))


def test_hf_cache_snapshot_from_refs_main(hub):
    repo = hub / "models--org--name"
    make_checkpoint(repo / "snapshots" / "aaa")
    want = make_checkpoint(repo / "snapshots" / "bbb")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb\n")
    assert resolve_checkpoint("org/name") == want.resolve()


def test_hf_cache_single_snapshot_without_refs_and_ambiguity(hub):
    repo = hub / "models--org--one"
    want = make_checkpoint(repo / "snapshots" / "abc")
    assert resolve_checkpoint("org/one") == want.resolve()
    make_checkpoint(repo / "snapshots" / "def")
    with pytest.raises(CheckpointError, match="holds 2 snapshots and no refs/main"):
        resolve_checkpoint("org/one")


def test_hf_home_is_the_fallback(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    monkeypatch.chdir(tmp_path)
    want = make_checkpoint(tmp_path / "hfhome" / "hub" / "models--org--name" / "snapshots" / "r1")
    assert resolve_checkpoint("org/name") == want.resolve()


def test_a_missing_checkpoint_says_where_it_looked(hub):
    with pytest.raises(CheckpointError) as exc:
        resolve_checkpoint("nvidia/Qwen3.5-122B-A10B-NVFP4")
    msg = str(exc.value)
    assert "not found" in msg and "local directory" in msg
    assert str(hub / "models--nvidia--Qwen3.5-122B-A10B-NVFP4") in msg and "HF_HUB_CACHE" in msg
    assert "does not download" in msg
    with pytest.raises(CheckpointError, match="local directory /no/such/dir"):
        resolve_checkpoint("/no/such/dir")


def test_refs_main_naming_a_missing_snapshot(hub):
    repo = hub / "models--org--name"
    make_checkpoint(repo / "snapshots" / "aaa")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("zzz")
    with pytest.raises(CheckpointError, match="names revision zzz"):
        resolve_checkpoint("org/name")


def test_demo_ids_need_the_entry_point_to_enable_them(monkeypatch):
    from dgpp import handoff

    monkeypatch.setattr(handoff, "_demo_builder", None)
    with pytest.raises(CheckpointError, match=r"demo checkpoint.*enable_demo_checkpoints\(\)"):
        resolve_checkpoint("dgpp-demo/qwen3-tiny")


def test_unknown_demo_is_refused(tmp_path, monkeypatch):
    from dgpp.demo import enable_demo_checkpoints

    enable_demo_checkpoints()
    monkeypatch.setenv("DGPP_DEMO_DIR", str(tmp_path))
    with pytest.raises(CheckpointError, match="no such demo checkpoint"):
        resolve_checkpoint("dgpp-demo/nonexistent")
