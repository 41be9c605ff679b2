"""The CLI's multi-rank surface: ``dgpp check`` reports the fabric; ``dgpp serve`` of a world needs ``--rank``."""

from __future__ import annotations

import json
import sys

from dgpp.cli import main
from dgpp.testing.builders import build_tiny_checkpoint


def _template(tmp_path, **extra) -> str:
    ckpt = build_tiny_checkpoint("qwen3", tmp_path / "ckpt", seed=3)
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps({"model": str(ckpt), "engine": {"kv_capacity": 1024}, **extra}))
    return str(path)


def test_check_reports_the_fabric_and_continues_on_tcp(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    assert main(["check", _template(tmp_path, world_size=2), "--free-gib", "64", "--headroom-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "world        2 rank(s)" in out
    assert "fabric: pyverbs is not installed: pip install 'dgpp-core[fabric]'; collectives use TCP" in out
    assert out.rstrip().endswith("ready")


def test_serve_of_a_world_without_rank_is_refused(tmp_path, capsys):
    assert main(["serve", _template(tmp_path, world_size=2)]) == 1
    err = capsys.readouterr().err
    assert "world of 2 ranks: give --rank R" in err and "dgpp launch" in err
