"""SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, optionally with clamped inputs (``swiglu_limit``:
``gate <= limit``, ``-limit <= up <= limit`` before the product, as DeepSeek-V4 and GLM-5.3-Flash train it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.family import World
from dgpp.nn.batch_invariant import batch_invariant_fused_linear, batch_invariant_rows
from dgpp.nn.linear import Linear, UnquantizedLinearMethod, fused_gate_up_silu


def clamp_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU inputs clamped at ``limit`` (asymmetric: the gate from above only, up on both sides); as is
    for ``None``."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up`` after ``clamp_swiglu(gate, up, limit)``."""
    if gate.is_cuda:  # one Triton pass (the clamps folded in) instead of clamps, silu and mul
        from dgpp import kernels

        return kernels.silu_mul_pair(gate, up, limit)
    gate, up = clamp_swiglu(gate, up, limit)
    # silu's vector tail: a row's bits must not depend on how many rows came with it (widths like 48 differ)
    return batch_invariant_rows(F.silu, gate, elementwise=True) * up


class SwiGLUMLP(nn.Module):
    """The dense MLP of Llama-style blocks; ``gate_proj``/``up_proj`` column-, ``down_proj`` row-parallel.
    ``swiglu_limit``: clamp the SwiGLU inputs (``clamp_swiglu``); the fused gate/up kernels, which do not
    clamp, are then skipped. ``bias``: all three projections carry one (Llama's ``mlp_bias``).
    ``prefill_width`` is the row width its gate/up/activation take over all ranks (the memory plan's)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype,
        world: World | None = None,
        swiglu_limit: float | None = None,
        bias: bool = False,
    ):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.prefill_width = intermediate_size
        self.gate_proj = Linear(
            hidden_size, intermediate_size, bias=bias, dtype=dtype, parallel="column", world=world
        )
        self.up_proj = Linear(
            hidden_size, intermediate_size, bias=bias, dtype=dtype, parallel="column", world=world
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias=bias, dtype=dtype, parallel="row", world=world
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is not None:
            return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))
        if x.is_cuda and dense_weights(
            self.gate_proj, self.up_proj
        ):  # decode: gate, up and SwiGLU in one launch
            from dgpp import kernels
            from dgpp.nn.exact import routing as exact_cuda

            wg, wu = self.gate_proj.weight, self.up_proj.weight
            routed = exact_cuda.routed_gate_up_silu(x, wg, wu, lambda rows: self._stock_gate_up(rows))
            if routed is not None:  # canonical rows through the fixed-order kernel (dgpp.nn.exact.routing)
                return self.down_proj(routed)
            if kernels.gemv_applies(x, self.gate_proj.weight, self.up_proj.weight):
                return self.down_proj(kernels.gate_up_silu(x, self.gate_proj.weight, self.up_proj.weight))
        elif x.is_cuda or not dense_weights(
            self.gate_proj, self.up_proj
        ):  # packed gate/up: one launch + SwiGLU
            fused = fused_gate_up_silu(self.gate_proj, self.up_proj, x)
            if fused is not None:
                return self.down_proj(fused)
        elif cpu_fusable(self.gate_proj, self.up_proj):  # CPU: gate and up as one row-wise product
            gate_up = batch_invariant_fused_linear(x, (self.gate_proj.weight, self.up_proj.weight))
            gate, up = gate_up.split(self.gate_proj.weight.shape[0], dim=-1)
            return self.down_proj(silu_and_mul(gate, up))
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))

    def _stock_gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """The gate/up + SwiGLU of bulk (prefill) rows: the decode GEMV for <= 64 rows, cuBLAS above."""
        from dgpp import kernels

        wg, wu = self.gate_proj.weight, self.up_proj.weight
        if kernels.gemv_applies(x, wg, wu):
            return kernels.gate_up_silu(x, wg, wu)
        return silu_and_mul(F.linear(x, wg), F.linear(x, wu))


def dense_weights(*layers: Linear) -> bool:
    """True when every layer holds a plain dense weight and no bias (the fused decode kernels' input)."""
    return all(
        isinstance(layer.quant_method, UnquantizedLinearMethod) and layer.bias is None for layer in layers
    )


def cpu_fusable(*layers: Linear) -> bool:
    """True when ``layers`` can run as one CPU product: dense, unbiased parameters of one dtype on the CPU."""
    if not dense_weights(*layers):
        return False
    weights = [layer.weight for layer in layers]
    return all(isinstance(w, nn.Parameter) and w.device.type == "cpu" for w in weights) and (
        len({w.dtype for w in weights}) == 1
    )
