"""Gated Residual (GR): Qwen3.8-Flash-Next's multi-stream residual ("hyper state").

The residual is ``hc_count`` streams of ``hidden`` each, held flat as ``[T, hc_count * hidden]`` (stream
major). Before a block, ``mix`` normalises each stream (zero-centred RMSNorm per stream), computes a
per-element sigmoid weight through a low-rank bottleneck (``up(silu(down(x̂) / hc))``), and averages the
weighted streams into the block's input ``[T, hidden]``. After the block, ``combine`` adds the block's
output into every stream with a per-stream weight ``2·σ(inject(x̂) / hc)``; streams are never mixed into
each other. The model's last GR (``use_combine=False``) only mixes: its output goes to the LM head.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.kernels._triton import use_triton
from dgpp.kernels.hyper_streams import (
    StreamMixInputs,
    StreamNormInputs,
    grouped_norm_ref,
    stream_mix,
    stream_norm,
)
from dgpp.nn.batch_invariant import batch_invariant_rows
from dgpp.nn.linear import Linear, UnquantizedLinearMethod
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
        return grouped_norm_ref(x, self.weight, self.group, self.eps)


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

    def _fused(self, hyper: torch.Tensor) -> bool:
        """The CUDA kernels apply: Triton on this device, and a plain expansion weight to read in the mix."""
        return use_triton(hyper) and isinstance(
            self.input_mix_weight_up.quant_method, UnquantizedLinearMethod
        )

    def normed(self, hyper: torch.Tensor) -> torch.Tensor:
        """Every stream normalised, ``[T, hc * hidden]``."""
        self._check(hyper)
        if self._fused(hyper):
            norm = self.hc_norm
            return stream_norm(StreamNormInputs(hyper, norm.weight, norm.eps, self.hc_count))[0]
        return self.hc_norm(hyper)

    def _weighted_mean(self, normed: torch.Tensor) -> torch.Tensor:
        low = self.input_mix_weight_down(normed)
        if self._fused(normed):
            up = cast(torch.Tensor, self.input_mix_weight_up.weight)  # plain: _fused checked the method
            return stream_mix(StreamMixInputs(normed, low, up, self.hc_count))
        # sigmoid / silu on padded rows: CPU vector tails would make a row depend on the step's row count
        gate = batch_invariant_rows(F.silu, low / self.hc_count)
        weights = batch_invariant_rows(torch.sigmoid, self.input_mix_weight_up(gate))
        weights = weights.unflatten(-1, (self.hc_count, self.hidden_size))
        return (weights * normed.unflatten(-1, (self.hc_count, self.hidden_size))).mean(dim=-2)

    def mix_only(self, hyper: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """The streams collapsed to ``[T, hidden]`` (the final mixer before the LM head)."""
        return self._weighted_mean(self.normed(hyper) if normed is None else normed)

    def mix(
        self, hyper: torch.Tensor, normed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block input ``[T, hidden]`` and the injection logits ``[T, hc_count]`` (``combine`` activates
        them). ``normed``: the streams already normalised by the previous ``combine``."""
        if self.block_inject_weight is None:
            raise RuntimeError("this gated residual has no block_inject_weight (use mix_only)")
        normed = self.normed(hyper) if normed is None else normed
        return self._weighted_mean(normed), self.block_inject_weight(normed)

    def combine(
        self,
        hyper: torch.Tensor,
        block_out: torch.Tensor,
        logits: torch.Tensor,
        then: GatedResidual | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``stream_i += 2σ(logits_i / hc) · block_out`` for every stream. With ``then`` (the next site) on the
        CUDA path, that site's norm runs in the same launch: returns ``(hyper, normed)``, else ``(hyper, None)``."""
        if then is not None and self._fused(hyper) and then._fused(hyper):
            norm = then.hc_norm
            step = StreamNormInputs(hyper, norm.weight, norm.eps, self.hc_count, block_out, logits)
            normed, hyper = stream_norm(step)
            return hyper, normed
        inject = 2 * batch_invariant_rows(torch.sigmoid, logits / self.hc_count)
        return hyper + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2), None
