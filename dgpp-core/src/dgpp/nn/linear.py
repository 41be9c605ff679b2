"""Linear layers that go through a pluggable ``LinearMethod``, so quantized formats can slot in later.

A layer declares how tensor parallelism splits it (``parallel``): ``"column"`` splits the output
features (dim 0 of the weight), ``"row"`` splits the input features (dim 1), ``"replicated"`` keeps it
whole. The parameters carry ``tp_dim`` and a ``weight_loader`` so the checkpoint loader can slice a
full tensor for this rank without knowing the layer.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import nn

from dgpp.family import World
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.weights import default_weight_loader, set_weight_attrs

Parallel = Literal["replicated", "column", "row"]


class LinearMethod(Protocol):
    """How a linear layer stores its weight and computes ``x @ W.T`` (dgpp.quant provides others)."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    """Plain dense weight ``[out, in]`` in the compute dtype."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(layer.out_local, layer.in_local, dtype=dtype), requires_grad=False)
        tp_dim = {"column": 0, "row": 1}.get(layer.parallel)
        set_weight_attrs(weight, tp_dim=tp_dim, world=layer.world, weight_loader=default_weight_loader)
        layer.weight = weight

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a dense weight with every row independent of the others in the call: on
    CUDA, canonical rows (decode, verify) through the fixed-order kernel (``dgpp.nn.exact.routing``) and
    decode rows through one Triton GEMV pass; on the CPU, ``batch_invariant_linear``."""
    if x.is_cuda:
        from dgpp.nn.exact import routing as exact_cuda

        routed = exact_cuda.routed_linears(
            x, [weight], lambda rows: [_stock_linear(rows, weight, bias)], bias
        )
        if routed is not None:
            return routed[0]
    return _stock_linear(x, weight, bias)


def _stock_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.is_cuda and bias is None:  # decode rows: one Triton GEMV pass, no split-K reduction
        from dgpp import kernels

        if kernels.gemv_applies(x, weight):
            return kernels.multi_linear(x, [weight])[0]
    return batch_invariant_linear(x, weight, bias)


def fused_linears(layers: tuple[Linear, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[layer(x) for layer in layers]`` in one launch when the first layer's method can fuse them (packed
    formats: ``dgpp.quant.linear.QuantLinearMethod.fused_linears``), else None (the caller's own path)."""
    fuse = getattr(layers[0].quant_method, "fused_linears", None)
    return None if fuse is None else fuse(layers, x)


def fused_gate_up_silu(gate: Linear, up: Linear, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate(x)) * up(x)`` in one launch when ``gate``'s method can fuse it (packed formats), else None."""
    fuse = getattr(gate.quant_method, "fused_gate_up_silu", None)
    return None if fuse is None else fuse(gate, up, x)


def row_block_linear(layer: Linear, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``x @ W[start:stop].T`` (no bias) for rows ``start:stop`` of ``layer``'s local weight, whatever its
    format: a block-diagonal projection (DeepSeek-V4's grouped ``wo_a``) multiplies each group by its own
    rows. Packed methods answer through their ``row_block`` (``dgpp.quant.linear``)."""
    rows = getattr(layer.quant_method, "row_block", None)
    if rows is not None:
        return rows(layer, x, start, stop)
    return dense_linear(x, layer.weight[start:stop])


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with TP split ``parallel`` over ``world``; the row-parallel all-reduce is the
    caller's (done once per block, after the residual-facing projection)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        parallel: Parallel = "replicated",
        world: World | None = None,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.world = world or World()
        self.parallel = parallel
        self.in_features = in_features
        self.out_features = out_features
        size = self.world.size
        if parallel == "column" and out_features % size:
            raise ValueError(f"column-parallel output size {out_features} is not divisible by world {size}")
        if parallel == "row" and in_features % size:
            raise ValueError(f"row-parallel input size {in_features} is not divisible by world {size}")
        self.out_local = out_features // size if parallel == "column" else out_features
        self.in_local = in_features // size if parallel == "row" else in_features
        self.quant_method: LinearMethod = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, dtype)
        if bias:
            # a row-parallel bias is added once (by rank 0's share), so it stays whole
            self.bias = nn.Parameter(torch.empty(self.out_local, dtype=dtype), requires_grad=False)
            set_weight_attrs(
                self.bias,
                tp_dim=0 if parallel == "column" else None,
                world=self.world,
                weight_loader=default_weight_loader,
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if self.parallel == "row" and self.world.rank != 0:
            bias = None  # the partial sums are all-reduced: only one rank may add the bias
        return self.quant_method.apply(self, x, bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, parallel={self.parallel}, bias={self.bias is not None}"
