"""End to end: ``dgpp serve`` of a tiny Qwen3.5 hybrid with ``engine.mtp`` and ``engine.dflash_model`` naming a
DFlash2 drafter checkpoint answers the openai SDK exactly as the runner's plain greedy decode (cold, prefix-cache
hit, concurrent), while ``/metrics`` counts the drafted block tokens."""

from __future__ import annotations

import httpx
import pytest
from served_greedy import QUESTIONS, SERVE_ENGINE, check_served_greedy, served

from dgpp.testing.builders import build_tiny_checkpoint
from dgpp_qwen.testing_dflash2 import build_tiny_dflash2

pytestmark = pytest.mark.e2e


def test_served_greedy_with_dflash2_equals_the_plain_runner(tmp_path) -> None:
    ckpt = build_tiny_checkpoint("qwen3_5", tmp_path / "ckpt", seed=33)
    drafter = build_tiny_dflash2(tmp_path / "drafter", ckpt, target_layer_ids=(1, 3), seed=34)
    engine = {**SERVE_ENGINE, "mtp": True, "mtp_depth": 3, "dflash_model": str(drafter)}
    with served(ckpt, tmp_path, engine=engine) as (server, sdk):
        check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=40)
        spec = httpx.get(server.url + "/metrics", timeout=10).json()["scheduler"]["spec_decode"]
    assert spec["depth"] == 3 and spec["num_draft_tokens_total"] > 0
