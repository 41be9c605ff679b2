"""Quantized linear: a ``LinearMethod`` for ``dgpp.nn.linear.Linear`` that keeps a format's tensors as shipped.

``create_weights`` registers one parameter per stored tensor (named by its checkpoint suffix, so
``q_proj.weight_scale_inv`` loads by name); ``apply`` computes ``x @ W^T`` with the Triton kernel on GPU
(reading the packed bytes) and, on CPU or for formats without a kernel, by decoding W to the activation
dtype (the reference path). Codes stay packed; E8M0 block scales widen exactly to float32 at load.

Canonical rows of a step (decode rows, speculative verify rows, every row under ``batch_invariant``) take the
engine's packed decode kernel whatever the step's row count: the tensor-core one (``decode_gemv``) in ONE launch
for all rows (64-row blocks above 16 rows, each packed weight read and decoded once per block), the CUDA-core
row GEMV in launches of at most ``MAX_ROWS`` rows, int4/int8 words, NF4I8 and GPTQ in one launch of their
row-exact GEMM (``int_rows``); either way a row's bits do not depend on the rows beside it;
prefill-chunk rows take the weight-only GEMM with its prefill tiles whatever the chunk length (``dgpp.nn.exact``
routes the rows). Off CUDA, with routing off or outside a
model step, the routed functions return None and the caller takes its own path. Under ``engine.prefill_fp8_gemm``
the prefill rows of FP8 block-scaled layers take the e4m3 GEMM instead (``dgpp.quant.fp8_prefill``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.nn.batch_invariant import batch_invariant_linear, native_row_products, native_rows_exact
from dgpp.nn.exact import routing
from dgpp.nn.mlp import silu_and_mul
from dgpp.policy import current
from dgpp.quant.format import QuantFormat, Shape
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.fp8_prefill import fp8_gemm_applies, fp8_linear, fp8_prefill_matmul
from dgpp.quant.intq import GPTQ
from dgpp.quant.kernels import (
    decode_gemv_applies,
    default_config,
    has_kernel,
    quant_gate_up_silu,
    quant_matmul,
    quant_multi_linear,
)
from dgpp.quant.kernels.decode_launch import MAX_ROWS, one_launch_for_any_rows
from dgpp.quant.kernels.int_rows_launch import int_rows_applies, int_rows_multi_linear, int_rows_supported
from dgpp.quant.params import check_tp_alignment, make_param, reblock_for_tp, tp_dim

Tensors = dict[str, torch.Tensor]  # a packed weight's stored tensors by name
Bias = torch.Tensor | None


def packed_matmul(
    fmt: QuantFormat, tensors: Tensors, x: torch.Tensor, shape: Shape, bias: Bias = None
) -> torch.Tensor:
    """``x @ W^T (+ bias)``: the Triton kernel on GPU, else decode to ``x.dtype`` and multiply (the reference);
    prefill rows through the fp8 GEMM under ``engine.prefill_fp8_gemm``."""
    y = fp8_prefill_matmul(
        fmt, tensors, x, shape, lambda rows: _exact_matmul(fmt, tensors, rows, shape, None)
    )
    if y is not None:
        return y if bias is None else y + bias
    return _exact_matmul(fmt, tensors, x, shape, bias)


def _exact_matmul(
    fmt: QuantFormat, tensors: Tensors, x: torch.Tensor, shape: Shape, bias: Bias
) -> torch.Tensor:
    """``packed_matmul``'s exact chain for every row (the bias where the product adds it)."""
    if x.is_cuda and has_kernel(fmt) and not current().quant_torch_only:
        y = quant_matmul(fmt, tensors, x, shape)
        return y if bias is None else y + bias
    return decoded_matmul(x, fmt.decode(tensors, shape, x.dtype), bias)


def decoded_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for a decoded weight: on the CPU, rows independent of the step and bit for bit
    what a dense Linear holding that weight computes (``dgpp.nn.batch_invariant``: narrow dtypes take the native
    product where its rows are exact for the shape, else multiply in fp32 and round once)."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if x.dtype in (torch.bfloat16, torch.float16) and not isinstance(
        weight, nn.Parameter
    ):  # (a Parameter's fp32 copy is cached)
        if weight.dtype == x.dtype and native_rows_exact(
            x.dtype, *weight.shape
        ):  # as a dense narrow Linear does
            y = native_row_products(x.reshape(-1, x.shape[-1]), weight).reshape(
                *x.shape[:-1], weight.shape[0]
            )
        else:
            y = batch_invariant_linear(x.float(), weight.float()).to(x.dtype)
        return y if bias is None else y + bias
    return batch_invariant_linear(x, weight, bias)


class QuantLinearMethod:
    """``LinearMethod`` for one format; ``fmt`` is the configured format (block size, bits, group)."""

    def __init__(self, fmt: QuantFormat, act_order: bool = False) -> None:
        self.fmt = fmt
        self.act_order = act_order and isinstance(fmt, GPTQ)

    def local_shape(self, layer: nn.Module) -> Shape:
        return (layer.out_local, layer.in_local)

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        shape = self.local_shape(layer)
        self.fmt, reblock = reblock_for_tp(self.fmt, shape, layer.parallel, layer.world.size)
        check_tp_alignment(self.fmt, shape, layer.parallel, layer.world.size)
        dim = tp_dim(self.fmt, layer.parallel)
        shapes = dict(self.fmt.tensor_shapes(shape))
        if self.act_order:
            if layer.parallel == "row" and layer.world.size > 1:
                # a K slice of a permuted g_idx points at groups other ranks hold
                raise ValueError("GPTQ act-order (desc_act) weights cannot be split row-parallel")
            shapes["g_idx"] = (shape[1],)
        layer.quant_tensor_names = tuple(shapes)
        for suffix, stored in shapes.items():
            own_dim = None if suffix == "g_idx" else dim  # g_idx is whole on every column-parallel rank
            setattr(
                layer, suffix, make_param(self.fmt, suffix, stored, own_dim, layer.world, reblock=reblock)
            )

    def adopt(self, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Install already-encoded tensors (a load-time conversion) in place of the layer's weight."""
        if "weight" in layer._parameters and "weight" not in tensors:
            del layer.weight
        layer.quant_method = self
        layer.quant_tensor_names = tuple(tensors)
        for suffix, t in tensors.items():
            setattr(layer, suffix, nn.Parameter(t, requires_grad=False))

    @staticmethod
    def fused_linears(layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
        """``dgpp.nn.linear.fused_linears`` for packed layers: ``fused_packed_linear``."""
        return fused_packed_linear(layers, x)

    @staticmethod
    def fused_gate_up_silu(gate: nn.Module, up: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``dgpp.nn.linear.fused_gate_up_silu`` for packed layers: ``fused_packed_gate_up_silu``."""
        return fused_packed_gate_up_silu(gate, up, x)

    def tensors(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        return {name: getattr(layer, name) for name in layer.quant_tensor_names}

    def dense_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The decoded [out_local, in_local] weight (reference path; also what a dense reference is given)."""
        return self.fmt.decode(self.tensors(layer), self.local_shape(layer), dtype)

    def row_block(self, layer: nn.Module, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``x @ W[start:stop]^T`` (``dgpp.nn.linear.row_block_linear``): the packed rows when the format can be
        cut there, else the rows of the decoded weight."""
        shape = self.local_shape(layer)
        tensors = self.tensors(layer)
        sliced = self.fmt.row_slice(tensors, shape, start, stop)
        if sliced is None:
            return decoded_matmul(x, self.fmt.decode(tensors, shape, x.dtype)[start:stop])
        return packed_matmul(self.fmt, sliced, x, (stop - start, shape[1]))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (
            x.is_cuda and bias is None
        ):  # canonical rows through the decode GEMV, whatever the step's row count
            routed = routed_packed_linears((layer,), x)
            if routed is not None:
                return routed[0]
        return packed_matmul(self.fmt, self.tensors(layer), x, self.local_shape(layer), bias)


def layer_tensors(layers: tuple[nn.Module, ...]) -> tuple[list[dict[str, torch.Tensor]], list[Shape]]:
    """The packed tensors and local [N, K] shape of each layer."""
    return (
        [layer.quant_method.tensors(layer) for layer in layers],
        [layer.quant_method.local_shape(layer) for layer in layers],
    )


def _shared_format(layers: tuple[nn.Module, ...]) -> QuantFormat | None:
    """The format of ``layers`` when all hold packed weights of one format and none has a bias, else None."""
    methods = [layer.quant_method for layer in layers]
    if not all(isinstance(m, QuantLinearMethod) for m in methods) or any(
        layer.bias is not None for layer in layers
    ):
        return None
    fmt = methods[0].fmt
    if any(m.fmt != fmt for m in methods) or current().quant_torch_only:
        return None
    return fmt


def shared_decode_format(layers: tuple[nn.Module, ...], x: torch.Tensor, on_gpu: bool) -> QuantFormat | None:
    """The format of ``layers`` when all hold packed weights of one format, none has a bias, and the
    packed decode GEMV takes ``x`` (a GPU, 1..16 rows): then they can share one launch. Else None."""
    fmt = _shared_format(layers)
    if fmt is None:
        return None
    tensor_sets, shapes = layer_tensors(layers)
    return fmt if decode_gemv_applies(fmt, tensor_sets, x, shapes, on_gpu) else None


def fused_packed_linear(layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[layer(x) for layer in layers]`` (1..3 packed layers, e.g. q/k/v) in one decode GEMV launch, or
    None when ``shared_decode_format`` says they cannot share one."""
    if x.is_cuda:  # canonical rows through the decode GEMV whatever the step's row count
        routed = routed_packed_linears(layers, x)
        if routed is not None:
            return routed
    fmt = shared_decode_format(layers, x, on_gpu=x.is_cuda)
    if fmt is None:
        return None
    tensor_sets, shapes = layer_tensors(layers)
    return quant_multi_linear(fmt, tensor_sets, x, shapes)


def fused_packed_gate_up_silu(gate: nn.Module, up: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate(x)) * up(x)`` in one decode GEMV launch for packed gate/up layers, or None."""
    if x.is_cuda:  # canonical rows through the decode GEMV whatever the step's row count
        routed = routed_packed_gate_up_silu(gate, up, x)
        if routed is not None:
            return routed
    fmt = shared_decode_format((gate, up), x, on_gpu=x.is_cuda)
    if fmt is None or gate.quant_method.local_shape(gate) != up.quant_method.local_shape(up):
        return None
    return quant_gate_up_silu(
        fmt,
        gate.quant_method.tensors(gate),
        up.quant_method.tensors(up),
        x,
        gate.quant_method.local_shape(gate),
    )


def _chunks(
    rows: torch.Tensor, launch: Callable[[torch.Tensor], list[torch.Tensor]], one_launch: bool
) -> list[torch.Tensor]:
    """``launch`` over all rows at once (``one_launch``: the tensor-core kernel) or over row chunks of at most
    MAX_ROWS (the row GEMV), outputs concatenated per weight."""
    if one_launch or rows.shape[0] <= MAX_ROWS:
        return launch(rows)
    parts = [launch(rows[i : i + MAX_ROWS]) for i in range(0, rows.shape[0], MAX_ROWS)]
    return [torch.cat(outs) for outs in zip(*parts, strict=True)]


def decode_rows(
    fmt: QuantFormat, tensor_sets: list[dict[str, torch.Tensor]], rows: torch.Tensor, shapes: list[Shape]
) -> list[torch.Tensor]:
    """``[rows @ W_i^T]`` through the packed decode GEMV for any number of rows (the canonical path); int32-word
    formats through their row-exact GEMM (``int_rows``), one launch for all rows."""
    if int_rows_supported(fmt):
        return int_rows_multi_linear(fmt, tensor_sets, rows, shapes)
    return _chunks(
        rows.contiguous(),
        lambda part: quant_multi_linear(fmt, tensor_sets, part, shapes),
        one_launch_for_any_rows(fmt, shapes),
    )


def _format(layers: tuple[nn.Module, ...], x: torch.Tensor) -> QuantFormat | None:
    """The layers' shared format when ``x`` can follow a route and the decode GEMV takes these weights (whether
    a step has a route at all is ``route_rows``'s call)."""
    if not routing.routable(x, []):
        return None
    fmt = _shared_format(layers)
    if fmt is not None and int_rows_supported(fmt):
        return fmt if int_rows_applies(fmt, layer_tensors(layers)[0], x, on_gpu=True) else None
    return shared_decode_format(layers, x[:1], on_gpu=True)


def _bulk_linears(fmt: QuantFormat, layers: tuple[nn.Module, ...], rows: torch.Tensor) -> list[torch.Tensor]:
    """A prefill chunk's rows: the weight-only GEMM with its prefill tiles at every chunk length (a chunk of
    13 rows and a 25-row one-shot prompt then give each row the same bits; the decode GEMV would not)."""
    sets, shapes = layer_tensors(layers)
    rows = rows.contiguous()
    if fp8_gemm_applies(fmt):  # engine.prefill_fp8_gemm: these are all prefill rows
        assert isinstance(fmt, FP8Block)
        return [fp8_linear(fmt, t, rows, s) for t, s in zip(sets, shapes, strict=True)]
    return [
        quant_matmul(fmt, t, rows, s, default_config(fmt, rows.shape[0], s, rows.device, gemm=True))
        for t, s in zip(sets, shapes, strict=True)
    ]


def routed_packed_linears(layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[layer(x) for layer in layers]`` (1..3 packed layers of one format, no bias) through the route, or None."""
    fmt = _format(layers, x)
    if fmt is None:
        return None
    sets, shapes = layer_tensors(layers)
    return routing.route_rows(
        x, lambda rows: decode_rows(fmt, sets, rows, shapes), lambda rows: _bulk_linears(fmt, layers, rows)
    )


def routed_packed_gate_up_silu(gate: nn.Module, up: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate(x)) * up(x)`` for packed gate/up layers through the route, or None."""
    fmt = _format((gate, up), x)
    if fmt is None or gate.quant_method.local_shape(gate) != up.quant_method.local_shape(up):
        return None
    (tg, tu), (shape, _) = layer_tensors((gate, up))

    def fused(rows: torch.Tensor) -> list[torch.Tensor]:
        if int_rows_supported(fmt):
            return [silu_and_mul(*int_rows_multi_linear(fmt, [tg, tu], rows, [shape, shape]))]
        return [quant_gate_up_silu(fmt, tg, tu, rows, shape)]

    def bulk(rows: torch.Tensor) -> list[torch.Tensor]:
        g, u = _bulk_linears(fmt, (gate, up), rows)
        return [silu_and_mul(g, u)]

    one_launch = int_rows_supported(fmt) or one_launch_for_any_rows(fmt, [shape])
    out = routing.route_rows(x, lambda rows: _chunks(rows.contiguous(), fused, one_launch), bulk)
    return None if out is None else out[0]
