"""SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.family import World
from dgpp.nn.linear import Linear


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.is_cuda:  # one Triton pass instead of silu + mul
        from dgpp import kernels

        return kernels.silu_mul_pair(gate, up)
    return F.silu(gate) * up


class SwiGLUMLP(nn.Module):
    """The dense MLP of Llama-style blocks; ``gate_proj``/``up_proj`` column-, ``down_proj`` row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, world: World | None = None):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, dtype=dtype, parallel="column", world=world)
        self.up_proj = Linear(hidden_size, intermediate_size, dtype=dtype, parallel="column", world=world)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, parallel="row", world=world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))
