"""GLM-5.3-Flash under tensor parallelism (2 ranks, gloo on CPU): KDA heads split (q/k/v, their convs, the decay
and beta projections, dt_bias / A_log, the output gate column-parallel; o_proj row-parallel), MLA heads split, the
indexer, mHC, norms and routers replicated, experts and the dense MLP split, the LM head vocab-parallel. Every
rank's logits and greedy tokens equal the single rank's, on prompts that run the sparse indexer path."""

from __future__ import annotations

import torch

from dgpp.family import World
from dgpp.startup.loading import load_model
from dgpp.testing.tp_ranks import assert_rank_matches_single, compared_outputs, run_on_ranks
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next

WORLD = 2


def _run(path: str, world: World) -> dict:
    model = load_model(path, world=world)
    spec = model.cache_spec()
    layers = model.stack.layers
    return {
        **compared_outputs(model, lengths=(6, 27)),
        "kda_state": spec["layers.0.self_attn"].tensors["recurrent"][0][0],
        "mla_heads": layers[1].self_attn.num_heads,
        "dt_bias": layers[0].self_attn.dt_bias.clone(),
        "pooled": spec["layers.1.self_attn.indexer"].head_dim,
    }


def test_tp2_matches_single_rank(tmp_path):
    path = build_tiny_glm5_next(tmp_path / "ckpt", seed=22)
    single = _run(str(path), World())
    for rank, got in enumerate(run_on_ranks(_run, path, tmp_path, WORLD)):
        assert (got["kda_state"], got["mla_heads"]) == (2, 2)  # 4 KDA heads, 4 MLA heads over 2 ranks
        assert got["pooled"] == single["pooled"]  # the indexer is replicated
        assert torch.equal(got["dt_bias"], single["dt_bias"][rank * 32 : (rank + 1) * 32])
        assert_rank_matches_single(rank, got, single)
