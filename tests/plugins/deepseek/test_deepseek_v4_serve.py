"""End to end: ``dgpp serve`` on a tiny DeepSeek-V4 checkpoint (window 6, HCA ratio 8, CSA ratio 4 with top-3
entries, all far shorter than the prompts) through the openai SDK. Chunked prefill under a token budget,
concurrent requests and a prefix-cache hit (the window rings and the open windows' rows restored from a state
snapshot, the compressed entries' pages shared) all return exactly the runner's greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

from dgpp.testing.deepseek_v4 import build_tiny_deepseek_v4
from dgpp.testing.tokenizers import build_tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))
from serve_fixture import running  # noqa: E402
from served_greedy import check_served_greedy  # noqa: E402

pytestmark = pytest.mark.e2e
ENGINE = {"max_concurrency": 4, "kv_capacity": 4096, "block_size": 4, "prefill_budget_tokens": 16,
          "prefix_min_tokens": 0, "prefix_cache_gib": 0.01, "default_max_tokens": 12, "stats_interval_s": 0}
QUESTIONS = ("What is the weather in Paris today?", "def add(a, b):", "The quick brown fox")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v4_serve")
    ckpt = build_tiny_deepseek_v4(root / "ckpt", seed=21, vocab_size=512)
    build_tiny_tokenizer(ckpt)
    with running(ckpt, root, ENGINE) as server:
        yield ckpt, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(env) -> None:
    ckpt, sdk = env
    check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=40)
