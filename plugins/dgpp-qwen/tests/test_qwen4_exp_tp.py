"""qwen4_exp under tensor parallelism (2 ranks, gloo on CPU): QSA and GDN heads, expert and shared-expert
intermediate dims split with one all-reduce per block; gated residuals, the indexer and PLE replicated; the
LM head vocab-parallel (logit shards gathered in rank order).
Logits and greedy tokens of every rank must equal the single-rank model's."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from dgpp.family import World
from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp

WORLD = 2


def _run(model) -> dict:
    prompts = conf.make_prompts(512, (9, 40), seed=31)
    return {
        "logits": conf.engine_all_logits(model, prompts),
        "tokens": greedy_generate(model, prompts, 10, chunk_size=7),
    }


def _rank_main(rank: int, path: str, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    try:
        torch.set_num_threads(1)
        model = load_model(path, world=World(rank=rank, size=WORLD))
        result = _run(model)
        result["kv_heads"] = model.cache_spec()["layers.1"].num_kv_heads
        result["head"] = (model.lm_head.vocab_parallel, model.lm_head.weight.clone())
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_tp2_matches_single_rank(tmp_path):
    path = build_tiny_qwen4_exp(tmp_path / "ckpt", seed=32)
    whole = load_model(path)
    single, head = _run(whole), whole.lm_head.weight
    mp.spawn(_rank_main, args=(str(path), str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    for rank, got in enumerate(ranks):
        # vocab-parallel head: the rank holds its slice of the untied checkpoint head, rows in rank order
        parallel, rows = got["head"]
        shard = head.shape[0] // WORLD
        assert parallel and rows.shape == (shard, head.shape[1])
        assert torch.equal(rows, head[rank * shard : (rank + 1) * shard])
        for ours, theirs in zip(got["logits"], ranks[0]["logits"], strict=True):
            assert torch.equal(ours, theirs), f"rank {rank} logits differ from rank 0's"
        assert got["kv_heads"] == 1  # 2 kv heads over 2 ranks
        for ours, ref in zip(got["logits"], single["logits"], strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert got["tokens"] == single["tokens"], (
            f"rank {rank} greedy tokens differ from the single-rank model"
        )
