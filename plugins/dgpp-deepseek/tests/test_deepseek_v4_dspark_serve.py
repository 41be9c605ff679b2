"""End to end: ``dgpp serve`` of a tiny DeepSeek-V4 checkpoint, and of the tiny DeepSeek-V4.1 release-layout
fixture, each with DSpark stages and ``engine.mtp`` on, answers the openai SDK exactly as the runner's plain greedy
decode (cold, prefix-cache hit, concurrent), while ``/metrics`` counts the drafted block tokens."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from deepseek_v41_fixture import add_dspark_stages_v41
from served_greedy import QUESTIONS, SERVE_ENGINE, check_served_greedy, served
from test_deepseek_v41 import build_fp32_fixture

from dgpp_deepseek.testing import add_dspark_stages, build_tiny_deepseek_v4

pytestmark = pytest.mark.e2e


def check_dspark_serves(ckpt: Path, root: Path) -> None:
    with served(ckpt, root, engine={**SERVE_ENGINE, "mtp": True, "mtp_depth": 3}) as (server, sdk):
        check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=40)
        spec = httpx.get(server.url + "/metrics", timeout=10).json()["scheduler"]["spec_decode"]
    assert spec["depth"] == 3 and spec["drafter"] == "mtp"
    assert spec["num_draft_tokens_total"] > 0


def test_served_greedy_with_dspark_equals_the_plain_runner(tmp_path) -> None:
    ckpt = build_tiny_deepseek_v4(tmp_path / "ckpt", seed=21, vocab_size=512)
    add_dspark_stages(ckpt, block_size=4, target_layer_ids=(1, 2, 3), seed=22)
    check_dspark_serves(ckpt, tmp_path)


def test_served_v41_greedy_with_dspark_equals_the_plain_runner(tmp_path) -> None:
    """V4.1's stages (single-pass hyper-connections, CSA2 window attention) over its compressed groups, Engram
    context and packed caches, drafting 3 deep through the server's verify step."""
    ckpt = build_fp32_fixture(tmp_path / "ckpt", seed=23)
    add_dspark_stages_v41(ckpt, block_size=4, target_layer_ids=(7, 8, 9), seed=24)
    check_dspark_serves(ckpt, tmp_path)
