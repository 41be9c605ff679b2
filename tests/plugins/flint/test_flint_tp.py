"""Flint under tensor parallelism (2 ranks, gloo on CPU): q/k/v heads and each head's sink split with them, the
window rings and paged K/V per rank's kv heads, dense / expert / shared-expert intermediate dims split, routers
and norms replicated, row-parallel outputs all-reduced. Every rank's logits and greedy tokens equal the
single-rank model's, on prompts longer than the window."""

from __future__ import annotations

import torch

from dgpp.engine.loading import load_model
from dgpp.family import World
from dgpp.testing import conformance as conf
from dgpp.testing.flint import build_tiny_flint
from dgpp.testing.generate import greedy_generate
from dgpp.testing.tp_ranks import run_on_ranks

WORLD = 2


@torch.inference_mode()
def _run(path: str, world: World) -> dict:
    model = load_model(path, world=world)
    prompts = conf.make_prompts(model.info.vocab_size, (6, 21), seed=31)
    spec = model.cache_spec()
    return {
        "logits": conf.engine_all_logits(model, prompts),
        "tokens": greedy_generate(model, prompts, 10, chunk_size=5),
        "sinks": model.model.layers[2].self_attn.sinks.clone(),
        "ring_heads": spec["layers.2.self_attn"].num_kv_heads,
        "paged_heads": spec["layers.0.self_attn"].num_kv_heads,
    }


def test_tp2_matches_single_rank(tmp_path):
    path = build_tiny_flint(tmp_path / "ckpt", seed=32)
    single = _run(str(path), World())
    for rank, got in enumerate(run_on_ranks(_run, path, tmp_path, WORLD)):
        assert got["ring_heads"] == got["paged_heads"] == 1  # 2 kv heads over 2 ranks
        assert torch.equal(got["sinks"], single["sinks"][rank * 2 : (rank + 1) * 2])  # 4 query heads' sinks
        for ours, ref in zip(got["logits"], single["logits"], strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert got["tokens"] == single["tokens"], f"rank {rank} greedy tokens differ from the single-rank model"
