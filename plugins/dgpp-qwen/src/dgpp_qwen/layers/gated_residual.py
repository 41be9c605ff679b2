"""Gated Residual (GR): Qwen3.8-Flash-Next's multi-stream residual ("hyper state").

The residual is ``hc_count`` streams of ``hidden`` each, held flat as ``[T, hc_count * hidden]`` (stream
major). Before a block, ``mix`` normalises each stream (zero-centred RMSNorm per stream), computes a
per-element sigmoid weight through a low-rank bottleneck (``up(silu(down(x̂) / hc))``), and averages the
weighted streams into the block's input ``[T, hidden]``. After the block, ``combine`` adds the block's
output into every stream with a per-stream weight ``2·σ(inject(x̂) / hc)``; streams are never mixed into
each other. The model's last GR (``use_combine=False``) only mixes: its output goes to the LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.nn.batch_invariant import batch_invariant_rows
from dgpp.nn.linear import Linear
from dgpp.nn.weights import default_weight_loader, set_weight_attrs


class GroupedRMSNorm(nn.Module):
    """Zero-centred RMSNorm applied to each ``group``-wide slice of the last dim: ``x̂ · (1 + w)`` in fp32,
    rounded to the input dtype once."""

    def __init__(self, dim: int, group: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        if dim % group:
            raise ValueError(f"grouped RMSNorm: dim {dim} is not a multiple of the group {group}")
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.float().unflatten(-1, (-1, self.group))
        normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedResidual(nn.Module):
    """One GR site. Parameter names follow the checkpoint (``hc_norm``, ``input_mix_weight_down``,
    ``input_mix_weight_up``, ``block_inject_weight``). Replicated under TP (it is small and per token)."""

    def __init__(
        self,
        hidden_size: int,
        hc_count: int,
        lowrank: int,
        eps: float,
        *,
        dtype: torch.dtype,
        use_combine: bool = True,
    ) -> None:
        super().__init__()
        self.hidden_size, self.hc_count = hidden_size, hc_count
        width = hc_count * hidden_size
        self.hc_norm = GroupedRMSNorm(width, hidden_size, eps, dtype=dtype)
        self.input_mix_weight_down = Linear(width, lowrank, dtype=dtype)
        self.input_mix_weight_up = Linear(lowrank, width, dtype=dtype)
        self.block_inject_weight = Linear(width, hc_count, dtype=dtype) if use_combine else None

    def _check(self, hyper: torch.Tensor) -> None:
        if hyper.shape[-1] != self.hc_count * self.hidden_size:
            raise ValueError(
                f"gated residual: expected {self.hc_count} x {self.hidden_size} features, got {hyper.shape[-1]}"
            )

    def _weighted_mean(self, normed: torch.Tensor) -> torch.Tensor:
        # sigmoid / silu on padded rows: CPU vector tails would make a row depend on the step's row count
        gate = batch_invariant_rows(F.silu, self.input_mix_weight_down(normed) / self.hc_count)
        weights = batch_invariant_rows(torch.sigmoid, self.input_mix_weight_up(gate))
        weights = weights.unflatten(-1, (self.hc_count, self.hidden_size))
        return (weights * normed.unflatten(-1, (self.hc_count, self.hidden_size))).mean(dim=-2)

    def mix_only(self, hyper: torch.Tensor) -> torch.Tensor:
        """The streams collapsed to ``[T, hidden]`` (the final mixer before the LM head)."""
        self._check(hyper)
        return self._weighted_mean(self.hc_norm(hyper))

    def mix(self, hyper: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block input ``[T, hidden]`` and the per-stream injection weights ``[T, hc_count]``."""
        if self.block_inject_weight is None:
            raise RuntimeError("this gated residual has no block_inject_weight (use mix_only)")
        self._check(hyper)
        normed = self.hc_norm(hyper)
        inject = 2 * batch_invariant_rows(torch.sigmoid, self.block_inject_weight(normed) / self.hc_count)
        return self._weighted_mean(normed), inject

    def combine(self, hyper: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """``stream_i += inject_i · block_out`` for every stream."""
        return hyper + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
