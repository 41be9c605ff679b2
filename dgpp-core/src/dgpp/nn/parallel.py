"""The one collective the shared layers need: summing row-parallel partial outputs over the TP group."""

from __future__ import annotations

from typing import Any

import torch

from dgpp.family import World


def all_reduce(x: torch.Tensor, world: World, group: Any = None) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group in place (a no-op on one rank); returns ``x``."""
    if world.size > 1:
        torch.distributed.all_reduce(x, group=group)
    return x
