"""The one collective the shared layers need: summing row-parallel partial outputs over the TP group."""

from __future__ import annotations

from typing import Any

import torch

from dgpp.family import World
from dgpp.nn.collectives import all_reduce_sum


def all_reduce(x: torch.Tensor, world: World, group: Any = None) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group in place (a no-op on one rank; half types summed in
    fp32 and rounded once, so every rank holds the same bits); returns ``x``."""
    return all_reduce_sum(x, world, group)
