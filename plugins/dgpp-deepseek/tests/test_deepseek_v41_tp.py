"""DeepSeek-V4.1-Flash under tensor parallelism (2 ranks, gloo on CPU): the CSA2 attention, its compressors and
indexers, the hyper-connections, the routers and Engram are replicated (one shared latent K/V head has nothing to
split by heads); the routed and shared experts' intermediate dims split and their partials all-reduced; the head
vocab-sharded. Every rank's logits and greedy tokens equal the single-rank model's, on prompts past the window,
the top-k and the candidate pool."""

from __future__ import annotations

import torch
from test_deepseek_v41 import build_fp32_fixture

from dgpp.family import World
from dgpp.startup.loading import load_model
from dgpp.testing.tp_ranks import assert_rank_matches_single, compared_outputs, run_on_ranks

WORLD = 2


def _run(path: str, world: World) -> dict:
    model = load_model(path, world=world)
    experts = model.layers[0].ffn.experts
    return {
        **compared_outputs(model, lengths=(6, 27)),
        "inter": experts.expert_weight("down_proj", 0, torch.float32).shape,
    }


def test_tp2_matches_single_rank(tmp_path):
    path = build_fp32_fixture(tmp_path / "ckpt", seed=3)
    single = _run(str(path), World())
    for rank, got in enumerate(run_on_ranks(_run, path, tmp_path, WORLD)):
        assert got["inter"][1] * WORLD == single["inter"][1]  # each rank holds half of every expert
        assert_rank_matches_single(rank, got, single)
