"""Greedy transcripts of every in-tree family through the whole serving engine, against recorded token ids.

Each fixture is a tiny random checkpoint served by ``build_backend`` (plugin resolution, loading,
pools, scheduler, step loop) with small prefill chunks, several requests in flight at once and a
repeated prompt (a prefix-cache hit), MTP on where the checkpoint has a drafter. The token ids each
request receives are compared with ``transcripts.json``, written by the engine on 2026-12-01 (commit
e9af83d, torch 2.13.0 CPU, fp32; the flint entry with the Flint plugin, on top of be219bc; the mimo entry with
the MiMo plugin, on top of e5ac5d1; the deepseek_v4 entry with the DeepSeek plugin, on top of eb726e8; the glm5_next
entry with the GLM plugin and the deepseek_v41 entry with the DeepSeek plugin on 2026-12-05, on top of ebde68a): a
refactor that changes any greedy token of any family fails here.

``DGPP_WRITE_TRANSCRIPTS=1`` rewrites the file (only for a change that is meant to alter outputs).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dgpp.config import parse_config
from dgpp.sample.params import SamplingParams
from dgpp.serve.generation import generation_request
from dgpp.server_assembly import build_backend
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.conformance import make_prompts
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp_deepseek.testing import build_tiny_deepseek_v4
from dgpp_deepseek.v41_testing import build_tiny_deepseek_v41
from dgpp_flint.testing import build_tiny_flint
from dgpp_glm.testing_glm4 import build_tiny_glm4_moe, nvfp4_twin
from dgpp_mimo.testing import build_tiny_mimo
from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp

GOLDEN = Path(__file__).with_name("transcripts.json")
NEW_TOKENS = 12
LENGTHS = (5, 23, 40, 9)  # prompts longer than the 16-token prefill chunk are prefilled in pieces


def _glm(out: Path) -> Path:
    return build_tiny_glm4_moe(out, seed=0, num_nextn_predict_layers=1)


def _glm_nvfp4(out: Path) -> Path:
    dense = build_tiny_glm4_moe(out / "dense", seed=0, nvfp4_grid=True)
    return nvfp4_twin(dense, out / "nvfp4", num_layers=3)


# name -> (checkpoint builder, engine.mtp)
FIXTURES: dict[str, tuple[Callable[[Path], Path], bool]] = {
    "qwen3": (lambda out: build_tiny_checkpoint("qwen3", out), False),
    "qwen3_moe": (lambda out: build_tiny_checkpoint("qwen3_moe", out), False),
    "qwen3_5": (lambda out: build_tiny_checkpoint("qwen3_5", out), False),
    "qwen3_5_moe": (lambda out: build_tiny_checkpoint("qwen3_5_moe", out), False),
    "qwen4_exp_mtp": (lambda out: build_tiny_qwen4_exp(out, with_mtp=True), True),
    "glm4_moe": (_glm, False),
    "glm4_moe_mtp": (_glm, True),
    "glm4_moe_nvfp4": (_glm_nvfp4, False),
    # sliding window 8: the prompts run past it, so the hit restores window rings from a state snapshot
    "flint": (lambda out: build_tiny_flint(out, seed=0, vocab_size=512), False),
    # window 8 with sinks, twice the KV heads and v 32 != q/k 48 on the sliding layers
    "mimo": (lambda out: build_tiny_mimo(out, seed=0, vocab_size=512), False),
    # window 6, HCA ratio 8, CSA ratio 4 keeping 3 entries: the hit restores rings and open windows, shares entries
    "deepseek_v4": (lambda out: build_tiny_deepseek_v4(out, seed=0, vocab_size=512), False),
    # KDA state, k-pooled indexer (kpool 4, 2 pools kept): the hit restores the KDA state and shares pooled keys
    "glm5_next": (lambda out: build_tiny_checkpoint("glm5_next", out), False),
    # CSA2: window 6, a ratio-2 and a ratio-1 group sharing compressed caches, top-4 inside a candidate pool,
    # Engram on two layers: the hit restores rings, the open pair and the token context, shares entries
    "deepseek_v41": (lambda out: build_tiny_deepseek_v41(out, seed=0), False),
}


async def _generate(engine, prompts: list[list[int]]) -> list[list[int]]:
    async def one(prompt: list[int]) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        handle = engine.submit(
            generation_request(
                "cmpl", prompt, params, engine.limits, named_limit=True, token_text=engine.token_text
            )
        )
        tokens: list[int] = []
        async for _, ev in handle.events():
            assert ev.error is None, ev.error
            tokens.extend(ev.tokens)
        return tokens

    together = await asyncio.gather(*(one(p) for p in prompts))  # batched, chunked prefill
    again = await one(prompts[2])  # the same prompt once more: a prefix-cache hit
    return [*together, again]


def transcript(name: str, root: Path) -> list[list[int]]:
    build, mtp = FIXTURES[name]
    ckpt = build(root / name)
    build_tiny_tokenizer(ckpt)
    cfg = parse_config(
        {
            "model": str(ckpt),
            "engine": {
                "max_concurrency": 4,
                "kv_capacity": 1024,
                "prefill_budget_tokens": 16,
                "prefix_min_tokens": 16,
                "mtp": mtp,
                "stats_interval_s": 0,
            },
        }
    )
    engine = build_backend(cfg, device="cpu")
    try:
        vocab = json.loads((ckpt / "config.json").read_text())
        vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
        return asyncio.run(_generate(engine, make_prompts(min(vocab, 500), LENGTHS, seed=7)))
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FIXTURES))
def test_greedy_transcript_matches_the_recorded_one(name: str, tmp_path: Path) -> None:
    got = transcript(name, tmp_path)
    assert all(len(t) == NEW_TOKENS for t in got), [len(t) for t in got]
    assert got[-1] == got[2], "prefix-cache hit changed the greedy continuation"
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("DGPP_WRITE_TRANSCRIPTS") == "1":
        recorded[name] = got
        GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    assert name in recorded, f"no recorded transcript for {name}: run with DGPP_WRITE_TRANSCRIPTS=1"
    assert got == recorded[name]
