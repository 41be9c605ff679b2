"""End to end: ``dgpp serve`` on a tiny qwen4_exp checkpoint through the openai SDK. Chunked prefill under a token
budget, concurrent requests, and a prefix-cache hit (state snapshot with the PLE context and conv history, shared
K/V and indexer-key pages) all return exactly the runner's greedy tokens, on prompts past the QSA dense limit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dgpp.testing.qwen4_exp import build_tiny_qwen4_exp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))
from served_greedy import QUESTIONS, check_served_greedy, served  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_exp_serve")
    ckpt = build_tiny_qwen4_exp(root / "ckpt", seed=61)
    with served(ckpt, root) as (server, sdk):
        yield server, ckpt, sdk


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(env) -> None:
    _, ckpt, sdk = env
    check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=19)  # past the indexer's dense limit
