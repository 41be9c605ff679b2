"""End to end: ``dgpp serve`` on a tiny qwen4_exp checkpoint through the openai SDK. Chunked prefill under a token
budget, concurrent requests, and a prefix-cache hit (state snapshot with the PLE context and conv history, shared
K/V and indexer-key pages) all return exactly the runner's greedy tokens, on prompts past the QSA dense limit."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from dgpp.engine.loading import load_model
from dgpp.testing.generate import greedy_generate
from dgpp.testing.qwen4_exp import build_tiny_qwen4_exp
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))
from serve_fixture import running  # noqa: E402

pytestmark = pytest.mark.e2e
NO_THINK = {"enable_thinking": False}
ENGINE = {"max_concurrency": 4, "kv_capacity": 4096, "block_size": 4, "prefill_budget_tokens": 16,
          "prefix_min_tokens": 0, "prefix_cache_gib": 0.01, "default_max_tokens": 12, "stats_interval_s": 0}
QUESTIONS = ("What is the weather in Paris today?", "def add(a, b):", "The quick brown fox")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_exp_serve")
    ckpt = build_tiny_qwen4_exp(root / "ckpt", seed=61)
    build_tiny_tokenizer(ckpt)
    with running(ckpt, root, ENGINE) as server:
        yield server, ckpt, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant. Think step by step. " * 3},
            {"role": "user", "content": question}]


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(env) -> None:
    server, ckpt, sdk = env

    def ask(question: str, **extra) -> openai.types.chat.ChatCompletion:
        return sdk.chat.completions.create(model=str(ckpt), messages=_messages(question), max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINK, **extra})

    tok = Tokenizer.from_dir(ckpt)
    template = ChatTemplate.for_checkpoint(tok)
    model = load_model(ckpt)
    prompts = [tok.encode(template.render(_messages(q), chat_template_kwargs=NO_THINK)) for q in QUESTIONS]
    assert min(len(p) for p in prompts) > 19  # past the indexer's dense limit
    want = [tok.decode(t, skip_special_tokens=True) for t in greedy_generate(model, prompts, 12, stop_at_eos=False)]

    cold = ask(QUESTIONS[0], prefix_cache=False)
    ask(QUESTIONS[0])
    hit = ask(QUESTIONS[0])
    assert cold.choices[0].message.content == hit.choices[0].message.content == want[0]
    assert hit.usage.prompt_tokens_details.cached_tokens >= 16
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(q).choices[0].message.content, QUESTIONS))
    assert together == want
