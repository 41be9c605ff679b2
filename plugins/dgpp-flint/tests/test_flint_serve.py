"""End to end: ``dgpp serve`` on a tiny Flint checkpoint (window 8, far shorter than the prompts) through the openai
SDK. Chunked prefill under a token budget, concurrent requests, and a prefix-cache hit (the sliding layers' rings
restored from a state snapshot, the full layers' pages shared) all return exactly the runner's greedy tokens."""

from __future__ import annotations

import pytest
from served_greedy import check_family_serves

from dgpp_flint.testing import build_tiny_flint

pytestmark = pytest.mark.e2e
WINDOW = 8


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(tmp_path) -> None:
    ckpt = build_tiny_flint(tmp_path / "ckpt", seed=21, vocab_size=512, sliding_window=WINDOW)
    check_family_serves(ckpt, tmp_path, min_prompt_tokens=4 * WINDOW)  # the window slides inside the prompt
