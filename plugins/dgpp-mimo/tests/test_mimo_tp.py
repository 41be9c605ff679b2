"""MiMo-V2-Flash under tensor parallelism (2 ranks, gloo on CPU): q heads and each head's sink split, the full layers'
and the sliding layers' (twice as many) kv heads split, so each rank's paged K/V and window rings hold its own kv
heads at q/k and v widths of their own; dense / expert intermediate dims split, routers and norms replicated,
row-parallel outputs all-reduced. Every rank's logits and greedy tokens equal the single-rank model's, on prompts
longer than the window."""

from __future__ import annotations

import torch

from dgpp.family import World
from dgpp.startup.loading import load_model
from dgpp.testing.tp_ranks import assert_rank_matches_single, compared_outputs, run_on_ranks
from dgpp_mimo.testing import build_tiny_mimo

WORLD = 2


def _run(path: str, world: World) -> dict:
    model = load_model(path, world=world)
    spec = model.cache_spec()
    ring, paged = spec["layers.1.self_attn"], spec["layers.0.self_attn"]
    return {
        **compared_outputs(model),
        "sinks": model.model.layers[1].self_attn.sinks.clone(),
        "ring": (ring.tensors["k"][0], ring.tensors["v"][0]),
        "paged": (paged.num_kv_heads, paged.head_dim, paged.v_dim),
    }


def test_tp2_matches_single_rank(tmp_path):
    path = build_tiny_mimo(tmp_path / "ckpt", seed=32)
    single = _run(str(path), World())
    for rank, got in enumerate(run_on_ranks(_run, path, tmp_path, WORLD)):
        assert got["paged"] == (1, 48, 32)  # 2 full-layer kv heads over 2 ranks
        assert got["ring"] == ((7, 2, 48), (7, 2, 32))  # 4 sliding-layer kv heads over 2 ranks, window 8
        assert torch.equal(got["sinks"], single["sinks"][rank * 4 : (rank + 1) * 4])  # 8 query heads' sinks
        assert_rank_matches_single(rank, got, single)
