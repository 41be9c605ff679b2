"""The collectives the models need, with deterministic folds.

Every rank must end bit-identical: a sum all-reduce gives every rank the same result (gloo and NCCL
both broadcast one fold to all ranks), and bf16/fp16 partials are summed in fp32 and rounded once
(so the fold's result does not depend on the wire dtype). The vocab-parallel head gathers its logit shards in rank order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dgpp.family import World

_HALF = (torch.bfloat16, torch.float16)


def all_reduce_sum(x: torch.Tensor, world: World, group: Any = None) -> torch.Tensor:
    """Sum ``x`` over the TP group in place (fp32 accumulation for half types); returns ``x``."""
    if world.size == 1:
        return x
    if x.dtype in _HALF:
        acc = x.float()
        dist.all_reduce(acc, group=group)
        x.copy_(acc)
    else:
        dist.all_reduce(x, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, world: World, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, rank 0 first (vocab shards -> full logits)."""
    if world.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world.size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)
