"""The commit a benchmark header names: the one it is told (``DGPP_COMMIT``), else this checkout's HEAD."""

from __future__ import annotations

import subprocess

from dgpp.bench.provenance import tree_commit


def test_named_commit_wins_over_the_checkout(monkeypatch):
    monkeypatch.setenv("DGPP_COMMIT", "abc1234")
    assert tree_commit() == "abc1234"


def test_checkout_head_without_a_name(monkeypatch):
    monkeypatch.delenv("DGPP_COMMIT", raising=False)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert tree_commit() == (head or "unknown")


def test_unknown_outside_a_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("DGPP_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert tree_commit() == "unknown"
