"""End to end: ``dgpp serve`` with prompt-lookup drafts (``engine.draft: "lookup"``) on a tiny Qwen3 checkpoint,
driven through the openai SDK over loopback: greedy answers equal the runner's plain greedy continuation, and
``/metrics`` counts the lookup drafter's drafts and accepted tokens."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from serve_fixture import Server, tiny_checkpoint

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.step.pools import CachePools
from dgpp.text.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
ENGINE = {
    "max_concurrency": 4,
    "kv_capacity": 4096,
    "block_size": 4,
    "prefill_budget_tokens": 16,
    "prefix_min_tokens": 0,
    "default_max_tokens": 16,
    "stats_interval_s": 1,
    "draft": "lookup",
    "draft_depth": 3,
    "lookup_ngram": 3,
    "lookup_min_ngram": 1,
}
PARAGRAPH = "the cat sat on the mat and the dog sat on the log and the cat saw the dog"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    ckpt = tiny_checkpoint("qwen3", root)
    server = Server(ckpt, root, ENGINE)
    try:
        server.wait_ready()
        yield {
            "server": server,
            "ckpt": ckpt,
            "tok": Tokenizer.from_dir(ckpt),
            "sdk": openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
        }
    finally:
        server.stop()


def _spec(env) -> dict:
    return httpx.get(env["server"].url + "/metrics", timeout=10).json()["scheduler"]["spec_decode"]


def _biased_greedy(model, prompt: list[int], bias: dict[int, float], n: int) -> list[int]:
    """Plain greedy with a logit bias, recomputing the whole sequence each token (the reference)."""
    pools = CachePools(model.cache_spec(), 32, 4, 1)
    runner, tokens = ModelRunner(model, pools), list(prompt)
    for _ in range(n):
        logits = runner.step([SeqWork(0, list(range(32)), 0, tokens)])[0].clone()
        for token, value in bias.items():
            logits[token] += value
        tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt) :]


def test_served_lookup_greedy_equals_plain_and_counts(env) -> None:
    model, tok, sdk = load_model(env["ckpt"]), env["tok"], env["sdk"]
    assert _spec(env)["drafter"] == "lookup"
    for text in (f"Repeat: {PARAGRAPH}. Again: {PARAGRAPH[:20]}", "def add(a, b): return a + b\ndef add("):
        want = greedy_generate(model, [tok.encode(text)], 20, stop_at_eos=False)[0]
        got = sdk.completions.create(
            model=str(env["ckpt"]), prompt=text, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == tok.decode(want, skip_special_tokens=True)
    # a paragraph whose tokens the output is held to (a logit bias): the lookup is right some of the time
    prompt = tok.encode(PARAGRAPH)
    bias = {t: 60.0 for t in sorted(set(prompt))[:4]}
    want = _biased_greedy(model, prompt, bias, 16)
    before = _spec(env)
    got = sdk.completions.create(
        model=str(env["ckpt"]),
        prompt=PARAGRAPH,
        max_tokens=16,
        temperature=0,
        logit_bias={str(t): v for t, v in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == tok.decode(want, skip_special_tokens=True)
    after = _spec(env)
    assert after["num_drafts_total"] > before["num_drafts_total"]
    assert after["num_accepted_tokens_total"] > before["num_accepted_tokens_total"]
    prometheus = httpx.get(env["server"].url + "/metrics/prometheus", timeout=10).text
    assert "dgpp_spec_decode_num_accepted_tokens_total" in prometheus
