"""Run one function on every rank of a CPU tensor-parallel world (gloo, one process a rank) and collect what each
rank returned: how the family TP tests compare every rank with the single-rank model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from dgpp.family import World

RankRun = Callable[[str, World], Any]


def _rank_main(rank: int, run: RankRun, path: str, out_dir: str, world_size: int) -> None:
    init = f"file://{Path(out_dir) / 'init'}"
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        torch.save(run(path, World(rank=rank, size=world_size)), Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def run_on_ranks(run: RankRun, path: str | Path, out_dir: str | Path, world_size: int) -> list[Any]:
    """``run(path, world)`` on each of ``world_size`` ranks (``run`` must be a module-level function); the results
    in rank order. ``out_dir`` holds the rendezvous file and each rank's result."""
    mp.spawn(_rank_main, args=(run, str(path), str(out_dir), world_size), nprocs=world_size, join=True)
    return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(world_size)]


@torch.inference_mode()
def compared_outputs(model: Any, lengths: tuple[int, ...] = (6, 21), new_tokens: int = 10) -> dict[str, Any]:
    """What a family's TP test compares between each rank and the single-rank model: every row's logits of fixed
    prompts, and their greedy continuations prefilled in chunks of 5."""
    from dgpp.offline import greedy_generate
    from dgpp.testing import conformance as conf

    prompts = conf.make_prompts(model.info.vocab_size, lengths, seed=31)
    return {
        "logits": conf.engine_all_logits(model, prompts),
        "tokens": greedy_generate(model, prompts, new_tokens, chunk_size=5),
    }


def assert_rank_matches_single(rank: int, got: dict[str, Any], single: dict[str, Any]) -> None:
    """Logits within 1e-5 (relative to each row's largest) and identical greedy tokens."""
    for ours, ref in zip(got["logits"], single["logits"], strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert got["tokens"] == single["tokens"], f"rank {rank} greedy tokens differ from the single-rank model"
