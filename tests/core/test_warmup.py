"""``engine.warmup``: the step mixes a server meets first, sent to itself before it listens, leave nothing behind
but compiled kernels: every KV block free again, no cached prefix, no counted request, and the same greedy
tokens for a request afterwards as on a server that never warmed up."""

from __future__ import annotations

import asyncio

import pytest

from dgpp.config import parse_config
from dgpp.sample.params import SamplingParams
from dgpp.serve.generation import generation_request
from dgpp.serve.warmup import warm_up
from dgpp.server_assembly import build_backend
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.tokenizers import build_tiny_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ckpt = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("warmup") / "qwen3")
    build_tiny_tokenizer(ckpt)
    return ckpt


def _backend(ckpt):
    return build_backend(
        parse_config(
            {"model": str(ckpt), "engine": {"stats_interval_s": 0, "max_concurrency": 8, "kv_capacity": 4096}}
        ),
        device="cpu",
    )


async def _greedy(backend, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    handle = backend.submit(
        generation_request(
            "cmpl", prompt, params, backend.limits, named_limit=True, token_text=backend.token_text
        )
    )
    tokens: list[int] = []
    async for _, ev in handle.events():
        tokens.extend(ev.tokens)
    return tokens


def test_warm_up_leaves_nothing_behind_and_changes_no_token(checkpoint):
    prompt = list(range(3, 40))
    cold = _backend(checkpoint)
    try:
        expected = asyncio.run(_greedy(cold, prompt))
    finally:
        cold.shutdown()
    warm = _backend(checkpoint)
    try:
        assert not warm.compiles_kernels  # a CPU engine: `dgpp serve` skips it; run here by hand
        sched = warm.loop.scheduler
        assert warm_up(warm, 8) >= 8 + 8 + 8  # the bursts up to the engine's width, the staggered ones
        assert sched.blocks.num_in_use == 0 and not sched.waiting and not sched.has_work
        assert warm.counters.requests_total == 0
        assert asyncio.run(_greedy(warm, prompt)) == expected
    finally:
        warm.shutdown()


def test_warm_up_fits_its_prompts_to_a_short_context(checkpoint):
    """A model whose context cannot hold a 128-token prompt and the decoding requests' 24 tokens warms up with
    shorter prompts instead of failing the server's start on a refused request."""
    from dataclasses import replace

    backend = _backend(checkpoint)
    try:
        backend.limits = replace(backend.limits, max_position=64)
        assert backend.limits.request_limit_tokens == 64
        assert warm_up(backend, 8) > 0
        assert backend.loop.scheduler.blocks.num_in_use == 0
    finally:
        backend.shutdown()
