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
