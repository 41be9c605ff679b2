"""GLM-4.7 under tensor parallelism (2 ranks, gloo on CPU): q/k/v heads (with their biases), the dense MLP,
every expert's and the shared expert's intermediate dim are split, the router and norms replicated, and each
block's row-parallel outputs all-reduced; the LM head (and an MTP layer's own head copy) is vocab-parallel,
logit shards gathered. Every rank's logits, greedy tokens and MTP draft must equal the single-rank model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dgpp.family import LoadContext, World
from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model, read_hf_config
from dgpp.testing import conformance as conf
from dgpp_glm.draft import build_draft
from dgpp_glm.testing_glm4 import build_tiny_glm4_moe

WORLD = 2


def _prompts() -> list[list[int]]:
    return conf.make_prompts(512, (9, 21), seed=21)


def _draft_logits(model, drafter) -> torch.Tensor:
    """MTP logits of one prompt (every row), after the main model's prefill of it."""
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.offline import make_pools

    tokens = _prompts()[1]
    n = len(tokens) - 1
    pools, blocks, _ = make_pools(model, [n], 16)
    model.keep_hidden = True  # what the speculative decoder turns on: the drafter reads every row
    model(build_batch([SeqWork(0, blocks.allocate(blocks.blocks_for_tokens(n)), 0, tokens[:n])], pools))
    pools, blocks, _ = make_pools(drafter, [n], 16)
    batch = build_batch([SeqWork(0, blocks.allocate(blocks.blocks_for_tokens(n)), 0, tokens[1:])], pools)
    batch.logits_indices = torch.arange(n)
    return drafter.compute_logits(drafter(batch, model.last_hidden)).float()


@torch.inference_mode()
def _run(path: str, world: World) -> dict:
    model = load_model(path, world=world)
    ctx = LoadContext(Path(path), read_hf_config(Path(path)), "glm", "Glm4MoeForCausalLM", world=world)
    drafter = build_draft(ctx, model)
    return {
        "logits": conf.engine_all_logits(model, _prompts()),
        "tokens": greedy_generate(model, _prompts(), 12, chunk_size=5),
        "draft": _draft_logits(model, drafter),
        "numel": sum(p.numel() for p in model.model.layers.parameters()),
        "kv_heads": model.cache_spec()["layers.0.self_attn"].num_kv_heads,
        "head": (
            model.lm_head.vocab_parallel,
            tuple(model.lm_head.weight.shape),
            model.lm_head.weight.clone(),
        ),
        "mtp_head_rows": [
            layer.shared_head.head.vocab_local for layer in drafter.layers if layer.shared_head.head
        ],
    }


def _rank_main(rank: int, path: str, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    try:
        torch.set_num_threads(1)
        torch.save(_run(path, World(rank=rank, size=WORLD)), Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("own_head", [False, True], ids=["mtp_shares_main_head", "mtp_own_head"])
def test_tp2_matches_single_rank(tmp_path, own_head):
    path = build_tiny_glm4_moe(tmp_path / "ckpt", seed=22, mtp_own_head=own_head)
    single = _run(str(path), World())
    mp.spawn(_rank_main, args=(str(path), str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    for rank, got in enumerate(ranks):
        # vocab-parallel head: the rank holds its slice of the untied checkpoint head, rows in rank order
        parallel, shape, rows = got["head"]
        whole = single["head"][2]
        shard = whole.shape[0] // WORLD
        assert not single["head"][0] and parallel and shape == (shard, whole.shape[1])
        assert got["mtp_head_rows"] == ([shard] if own_head else [])  # the MTP layer's own head copy too
        assert torch.equal(rows, whole[rank * shard : (rank + 1) * shard])
        for ours, theirs in zip(got["logits"], ranks[0]["logits"], strict=True):
            assert torch.equal(ours, theirs), f"rank {rank} logits differ from rank 0's"
        assert got["kv_heads"] == 1  # 2 kv heads over 2 ranks
        assert got["numel"] < 0.6 * single["numel"]  # only norms, routers and the correction bias are whole
        for ours, ref in zip(got["logits"], single["logits"], strict=True):
            # same math with partial sums added in another order: fp32 rounding only
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert got["tokens"] == single["tokens"], (
            f"rank {rank} greedy tokens differ from the single-rank model"
        )
        torch.testing.assert_close(
            got["draft"], single["draft"], rtol=1e-5, atol=1e-5 * float(single["draft"].abs().max())
        )
