"""Flint under tensor parallelism (2 ranks, gloo on CPU): q/k/v heads and each head's sink split with them, the
window rings and paged K/V per rank's kv heads, dense / expert / shared-expert intermediate dims split, routers
and norms replicated, row-parallel outputs all-reduced. Every rank's logits and greedy tokens equal the
single-rank model's, on prompts longer than the window."""

from __future__ import annotations

import torch

from dgpp.family import World
from dgpp.startup.loading import load_model
from dgpp.testing.tp_ranks import assert_rank_matches_single, compared_outputs, run_on_ranks
from dgpp_flint.testing import build_tiny_flint

WORLD = 2


def _run(path: str, world: World) -> dict:
    model = load_model(path, world=world)
    spec = model.cache_spec()
    return {
        **compared_outputs(model),
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
        assert_rank_matches_single(rank, got, single)
