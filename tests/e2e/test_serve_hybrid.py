"""End to end on a tiny hybrid Qwen3.5 (Gated DeltaNet + attention): the prefix cache restores state snapshots,
and a hit returns exactly what a cold run returns."""

from __future__ import annotations

import openai
import pytest
from serve_fixture import Server, tiny_checkpoint

from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
NO_THINK = {"enable_thinking": False}
ENGINE = {
    "max_concurrency": 4,
    "kv_capacity": 4096,
    "block_size": 4,
    "prefill_budget_tokens": 16,
    "prefix_min_tokens": 0,
    "prefix_cache_gib": 0.01,
    "default_max_tokens": 12,
    "stats_interval_s": 0,
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    ckpt = tiny_checkpoint("qwen3_5", root)
    server = Server(ckpt, root, ENGINE)
    try:
        server.wait_ready()
        yield server, ckpt, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    finally:
        server.stop()


def test_hybrid_prefix_hit_equals_cold_and_the_runner(env) -> None:
    server, ckpt, sdk = env
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Think step by step. " * 3},
        {"role": "user", "content": "What is the weather in Paris today?"},
    ]

    def ask(**extra):
        return sdk.chat.completions.create(
            model=str(ckpt),
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINK, **extra},
        )

    cold = ask(prefix_cache=False)
    first = ask()
    hit = ask()
    texts = {
        cold.choices[0].message.content,
        first.choices[0].message.content,
        hit.choices[0].message.content,
    }
    assert len(texts) == 1
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.usage.prompt_tokens_details.cached_tokens >= 16
    assert hit.usage.prompt_tokens_details.cached_tokens % 16 == 0  # attached at a chunk cut with a snapshot
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode(ChatTemplate.for_checkpoint(tok).render(messages, chat_template_kwargs=NO_THINK))
    want = greedy_generate(load_model(ckpt), [ids], 12, stop_at_eos=False)[0]
    assert texts.pop() == tok.decode(want, skip_special_tokens=True)
    import httpx

    pc = httpx.get(server.url + "/metrics").json()["prefix_cache"]
    assert pc["snapshots"] >= 1 and pc["hits"] >= 1 and pc["slots"] > 0
    assert pc["arena_attaches"] >= 1 and pc["snapshot_bytes"] > 0 and pc["ttft_hit_count"] >= 1
