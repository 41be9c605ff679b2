"""End to end: ``dgpp serve`` on a tiny Flint checkpoint (window 8, far shorter than the prompts) through the openai
SDK. Chunked prefill under a token budget, concurrent requests, and a prefix-cache hit (the sliding layers' rings
restored from a state snapshot, the full layers' pages shared) all return exactly the runner's greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dgpp.testing.flint import build_tiny_flint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))
from served_greedy import QUESTIONS, check_served_greedy, served  # noqa: E402

pytestmark = pytest.mark.e2e
WINDOW = 8


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("flint_serve")
    ckpt = build_tiny_flint(root / "ckpt", seed=21, vocab_size=512, sliding_window=WINDOW)
    with served(ckpt, root) as (_, sdk):
        yield ckpt, sdk


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(env) -> None:
    ckpt, sdk = env
    check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=4 * WINDOW)  # the window slides inside the prompt
