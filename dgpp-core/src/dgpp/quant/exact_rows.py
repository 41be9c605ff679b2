"""Packed (quantized) linears through the step's exactness route (``dgpp.nn.exact_cuda``).

Canonical rows (decode rows, speculative verify rows, every row under ``engine.batch_invariant``) take the
packed decode GEMV whatever the step's row count: launches of at most ``MAX_ROWS`` rows, in each of which a
row's bits do not depend on the rows beside it. Without the route, a decode step of more than 16 rows (a
busy server, or verify rows of several requests) went to the weight-only GEMM, whose bits depend on M.
Prefill-chunk rows take the weight-only GEMM with its prefill tiles whatever the chunk length.
Off CUDA, with routing off (``DGPP_EXACT=0``) or outside a model step, every function returns None and the
caller takes its own path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dgpp.quant.format import QuantFormat, Shape
from dgpp.quant.kernels.decode_launch import MAX_ROWS


def _chunks(rows: torch.Tensor, launch: Callable[[torch.Tensor], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``launch`` over row chunks of at most MAX_ROWS, outputs concatenated per weight."""
    if rows.shape[0] <= MAX_ROWS:
        return launch(rows)
    parts = [launch(rows[i : i + MAX_ROWS]) for i in range(0, rows.shape[0], MAX_ROWS)]
    return [torch.cat(outs) for outs in zip(*parts, strict=True)]


def decode_rows(fmt: QuantFormat, tensor_sets: list[dict[str, torch.Tensor]], rows: torch.Tensor,
                shapes: list[Shape]) -> list[torch.Tensor]:
    """``[rows @ W_i^T]`` through the packed decode GEMV for any number of rows (the canonical path)."""
    from dgpp.quant.kernels import quant_multi_linear

    return _chunks(rows.contiguous(), lambda part: quant_multi_linear(fmt, tensor_sets, part, shapes))


def _format(layers: tuple[nn.Module, ...], x: torch.Tensor) -> QuantFormat | None:
    """The layers' shared format when ``x`` can follow a route and the decode GEMV takes these weights (whether
    a step has a route at all is ``route_rows``'s call)."""
    from dgpp.nn import exact_cuda
    from dgpp.quant.linear import shared_decode_format

    if not exact_cuda.routable(x, []):
        return None
    return shared_decode_format(layers, x[:1], on_gpu=True)


def _bulk_linears(fmt: QuantFormat, layers: tuple[nn.Module, ...], rows: torch.Tensor) -> list[torch.Tensor]:
    """A prefill chunk's rows: the weight-only GEMM with its prefill tiles at every chunk length (a chunk of
    13 rows and a 25-row one-shot prompt then give each row the same bits; the decode GEMV would not)."""
    from dgpp.quant.kernels import default_config, quant_matmul
    from dgpp.quant.linear import layer_tensors

    sets, shapes = layer_tensors(layers)
    rows = rows.contiguous()
    return [quant_matmul(fmt, t, rows, s, default_config(fmt, rows.shape[0], s, rows.device, gemm=True))
            for t, s in zip(sets, shapes, strict=True)]


def routed_packed_linears(layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[layer(x) for layer in layers]`` (1..3 packed layers of one format, no bias) through the route, or None."""
    from dgpp.nn import exact_cuda
    from dgpp.quant.linear import layer_tensors

    fmt = _format(layers, x)
    if fmt is None:
        return None
    sets, shapes = layer_tensors(layers)
    return exact_cuda.route_rows(x, lambda rows: decode_rows(fmt, sets, rows, shapes),
                                 lambda rows: _bulk_linears(fmt, layers, rows))


def routed_packed_gate_up_silu(gate: nn.Module, up: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate(x)) * up(x)`` for packed gate/up layers through the route, or None."""
    from dgpp.nn import exact_cuda
    from dgpp.nn.mlp import silu_and_mul
    from dgpp.quant.kernels import quant_gate_up_silu
    from dgpp.quant.linear import layer_tensors

    fmt = _format((gate, up), x)
    if fmt is None or gate.quant_method.local_shape(gate) != up.quant_method.local_shape(up):
        return None
    (tg, tu), (shape, _) = layer_tensors((gate, up))

    def fused(rows: torch.Tensor) -> list[torch.Tensor]:
        return [quant_gate_up_silu(fmt, tg, tu, rows, shape)]

    def bulk(rows: torch.Tensor) -> list[torch.Tensor]:
        g, u = _bulk_linears(fmt, (gate, up), rows)
        return [silu_and_mul(g, u)]

    out = exact_cuda.route_rows(x, lambda rows: _chunks(rows.contiguous(), fused), bulk)
    return None if out is None else out[0]
