"""The collectives' folds: bf16 partials summed in fp32 and rounded once, the same bits on every rank;
vocab shards gathered in rank order."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tp_harness import free_port

from dgpp.family import World
from dgpp.nn.collectives import all_gather_last_dim, all_reduce_sum

SIZE = 4


def _partials() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    # magnitudes far apart: a bf16 running sum would lose the small terms that fp32 keeps
    return [(torch.randn(64, generator=gen) * 10 ** (2 - r)).to(torch.bfloat16) for r in range(SIZE)]


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    try:
        world = World(rank, SIZE)
        reduced = all_reduce_sum(_partials()[rank].clone(), world)
        shard = torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2) + 100 * rank
        gathered = all_gather_last_dim(shard, world)
        torch.save({"reduced": reduced, "gathered": gathered}, Path(out) / f"r{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_half_all_reduce_is_fp32_folded_and_identical_everywhere(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=SIZE, join=True)
    results = [torch.load(tmp_path / f"r{r}.pt") for r in range(SIZE)]
    exact = torch.stack([p.float() for p in _partials()]).sum(0).to(torch.bfloat16)
    for got in results:
        assert got["reduced"].dtype == torch.bfloat16
        assert torch.equal(got["reduced"], results[0]["reduced"])
        torch.testing.assert_close(got["reduced"], exact, rtol=0, atol=0)
        expected = torch.cat([torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * r for r in range(SIZE)], -1)
        assert torch.equal(got["gathered"], expected)
