"""Full GLM-5.3 under tensor parallelism (2 ranks, gloo on CPU): MLA heads split (q_b_proj / kv_b_proj
column-, o_proj row-parallel), the latent path, the indexer, norms and routers replicated, experts and the
dense MLP split, the LM head vocab-parallel. Every rank's logits and greedy tokens equal the single rank's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dgpp.family import World
from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

WORLD = 2


def _prompts() -> list[list[int]]:
    return conf.make_prompts(512, (9, 21), seed=21)


@torch.inference_mode()
def _run(path: str, world: World, kv_dtype: str = "auto") -> dict:
    model = load_model(path, world=world)
    attn = model.model.layers[0].self_attn
    return {
        "logits": conf.engine_all_logits(model, _prompts(), kv_dtype=kv_dtype),
        "tokens": greedy_generate(model, _prompts(), 12, chunk_size=5, kv_dtype=kv_dtype),
        "heads": attn.num_heads,
        "latent": model.cache_spec()["layers.0.self_attn"].latent_dim,
    }


def _rank_main(rank: int, path: str, init_file: str, out_dir: str, kv_dtype: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    try:
        torch.set_num_threads(1)
        torch.save(_run(path, World(rank=rank, size=WORLD), kv_dtype), Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp4"])
def test_tp2_matches_single_rank(tmp_path, kv_dtype):
    """Also with ``engine.kv_dtype: fp4``: every rank quantizes the replicated latents and index keys alike."""
    path = build_tiny_glm_moe_dsa(tmp_path / "ckpt", seed=22)
    single = _run(str(path), World(), kv_dtype)
    args = (str(path), str(tmp_path / "init"), str(tmp_path), kv_dtype)
    mp.spawn(_rank_main, args=args, nprocs=WORLD, join=True)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert (
            got["heads"] == single["heads"] // WORLD and got["latent"] == single["latent"]
        )  # latent replicated
        for ours, ref in zip(got["logits"], single["logits"], strict=True):
            # same math with partial sums added in another order: fp32 rounding only
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert got["tokens"] == single["tokens"], (
            f"rank {rank} greedy tokens differ from the single-rank model"
        )
