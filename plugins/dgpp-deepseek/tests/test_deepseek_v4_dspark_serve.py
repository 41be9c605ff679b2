"""End to end: ``dgpp serve`` of a tiny DeepSeek-V4 checkpoint with DSpark stages and ``engine.mtp`` on answers the
openai SDK exactly as the runner's plain greedy decode (cold, prefix-cache hit, concurrent), while ``/metrics``
counts the drafted block tokens."""

from __future__ import annotations

import httpx
import pytest
from served_greedy import QUESTIONS, SERVE_ENGINE, check_served_greedy, served

from dgpp_deepseek.testing import add_dspark_stages, build_tiny_deepseek_v4

pytestmark = pytest.mark.e2e


def test_served_greedy_with_dspark_equals_the_plain_runner(tmp_path) -> None:
    ckpt = build_tiny_deepseek_v4(tmp_path / "ckpt", seed=21, vocab_size=512)
    add_dspark_stages(ckpt, block_size=4, target_layer_ids=(1, 2, 3), seed=22)
    with served(ckpt, tmp_path, engine={**SERVE_ENGINE, "mtp": True, "mtp_depth": 3}) as (server, sdk):
        check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=40)
        spec = httpx.get(server.url + "/metrics", timeout=10).json()["scheduler"]["spec_decode"]
    assert spec["depth"] == 3 and spec["drafter"] == "mtp"
    assert spec["num_draft_tokens_total"] > 0
