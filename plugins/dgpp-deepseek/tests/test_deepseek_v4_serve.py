"""End to end: ``dgpp serve`` on a tiny DeepSeek-V4 checkpoint (window 6, HCA ratio 8, CSA ratio 4 with top-3
entries, all far shorter than the prompts) through the openai SDK. Chunked prefill under a token budget,
concurrent requests and a prefix-cache hit (the window rings and the open windows' rows restored from a state
snapshot, the compressed entries' pages shared) all return exactly the runner's greedy tokens."""

from __future__ import annotations

import pytest
from served_greedy import check_family_serves

from dgpp_deepseek.testing import build_tiny_deepseek_v4

pytestmark = pytest.mark.e2e


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(tmp_path) -> None:
    ckpt = build_tiny_deepseek_v4(tmp_path / "ckpt", seed=21, vocab_size=512)
    check_family_serves(ckpt, tmp_path, min_prompt_tokens=40)
