"""End to end: ``dgpp serve`` on a tiny qwen4_exp checkpoint through the openai SDK. Chunked prefill under a token
budget, concurrent requests, and a prefix-cache hit (state snapshot with the PLE context and conv history, shared
K/V and indexer-key pages) all return exactly the runner's greedy tokens, on prompts past the QSA dense limit."""

from __future__ import annotations

import pytest
from served_greedy import check_family_serves

from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp

pytestmark = pytest.mark.e2e


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(tmp_path) -> None:
    ckpt = build_tiny_qwen4_exp(tmp_path / "ckpt", seed=61)
    check_family_serves(ckpt, tmp_path, min_prompt_tokens=19)  # past the indexer's dense limit
