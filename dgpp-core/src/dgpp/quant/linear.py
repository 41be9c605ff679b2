"""Quantized linear: a ``LinearMethod`` for ``dgpp.nn.linear.Linear`` that keeps a format's tensors as shipped.

``create_weights`` registers one parameter per stored tensor (named by its checkpoint suffix, so
``q_proj.weight_scale_inv`` loads by name); ``apply`` computes ``x @ W^T`` with the Triton kernel on GPU
(reading the packed bytes) and, on CPU or for formats without a kernel, by decoding W to the activation
dtype (the reference path). Codes stay packed; E8M0 block scales widen exactly to float32 at load.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.nn.weights import WeightShapeError, narrow_for_rank, set_weight_attrs
from dgpp.quant.codecs import scale_to_float
from dgpp.quant.format import QuantFormat, Shape
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import GPTQ
from dgpp.quant.kernels import (
    decode_gemv_applies,
    has_kernel,
    quant_gate_up_silu,
    quant_matmul,
    quant_multi_linear,
)

TORCH_ONLY_ENV = "DGPP_QUANT_TORCH"  # "1": always use the decode path (debugging, A/B against the kernels)


def storage_dtype(fmt: QuantFormat, suffix: str, shipped: tuple[int, ...]) -> torch.dtype:
    """Resident dtype of a stored tensor: codes keep their bytes; float scales start as float32, which
    holds E8M0 exactly, and 2-byte scales switch to their shipped dtype when they load."""
    if isinstance(fmt, FP8Block):
        return torch.float8_e4m3fn if suffix == "weight" else torch.float32
    if isinstance(fmt, FP4Grouped):
        return torch.float32 if suffix == fmt.global_name else torch.uint8
    if suffix in ("weight_packed", "qweight", "qzeros", "g_idx"):
        return torch.int32
    return torch.float32


def tp_dim(fmt: QuantFormat, parallel: str) -> int | None:
    """The dim of every non-scalar stored tensor that TP slices (GPTQ tensors are stored [K, N])."""
    if parallel == "replicated":
        return None
    column = parallel == "column"
    if isinstance(fmt, GPTQ):
        return 1 if column else 0
    return 0 if column else 1


def reblock_for_tp(fmt: QuantFormat, local: Shape, parallel: str, world_size: int) -> tuple[QuantFormat, tuple[int, int]]:
    """An FP8 block grid whose TP slice does not start on a block boundary (Qwen experts: 640/W rows on
    128-row blocks) is re-blocked to the gcd with replicated scales, which is exact. Returns the
    rank's format and the (rows, cols) replication factors (1, 1 when nothing changes)."""
    if type(fmt) is not FP8Block or world_size == 1 or parallel == "replicated":
        return fmt, (1, 1)
    (bn, bk), (n, k) = fmt.block, local
    fine = (math.gcd(n, bn), bk) if parallel == "column" else (bn, math.gcd(k, bk))
    if fine == (bn, bk):
        return fmt, (1, 1)
    return fmt.with_params(block=fine), (bn // fine[0], bk // fine[1])


def check_tp_alignment(fmt: QuantFormat, local: Shape, parallel: str, world_size: int) -> None:
    """Each rank's slice must start and end on the format's scale-block / group / word boundaries; raises
    ValueError naming why. Call it after ``reblock_for_tp``: FP8 block grids are re-blocked there (so they
    always pass), while FP4 groups, GPTQ words/groups and other group formats cannot be re-blocked."""
    if world_size == 1 or parallel == "replicated":
        return
    n, k = local
    if isinstance(fmt, FP8Block):
        bn, bk = fmt.block_for((n, k))
        unit, size = (bn, n) if parallel == "column" else (bk, k)
    elif isinstance(fmt, FP4Grouped):
        unit, size = (1, n) if parallel == "column" else (fmt.group, k)
    elif isinstance(fmt, GPTQ):
        unit, size = (32 // fmt.bits, n) if parallel == "column" else (fmt.group_size((n, k)), k)
    else:
        group = getattr(fmt, "group", 0) or k
        unit, size = (1, n) if parallel == "column" else (group, k)
    if size % unit:
        raise ValueError(
            f"{parallel}-parallel slice of {size} per rank is not a multiple of the {fmt.name} block/group/word "
            f"of {unit} (world {world_size}); this format cannot be re-blocked"
        )


def load_packed(param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
    """Checkpoint tensor -> resident parameter (``shard`` = expert index for stacked expert tensors)."""
    if param.dtype == torch.float32 and loaded.dtype in (torch.bfloat16, torch.float16) and shard in (None, 0):
        # 2-byte scales stay as shipped (what packed_bytes counts); kernels widen them in registers
        param.data = torch.empty(param.shape, dtype=loaded.dtype, device=param.device)
    copy_packed(param if shard is None else param[shard], loaded, param)


def copy_packed(dst: torch.Tensor, loaded: torch.Tensor, attrs: torch.Tensor) -> None:
    """Same bytes for codes, exact float32 for scales, then this rank's TP slice (``attrs`` carries
    ``tp_dim``/``world``/``e8m0``)."""
    if dst.dtype == torch.float32:
        if loaded.dtype in (torch.int32, torch.int64):
            raise WeightShapeError(f"dtype {loaded.dtype} is not a scale dtype")
        loaded = scale_to_float(loaded, e8m0=getattr(attrs, "e8m0", False))
    elif dst.element_size() == 1 and loaded.element_size() == 1:
        loaded = loaded.view(dst.dtype)
    elif loaded.dtype != dst.dtype:
        raise WeightShapeError(f"dtype {loaded.dtype} cannot be loaded into a {dst.dtype} parameter")
    if dst.numel() == 1 and loaded.numel() == 1:
        loaded = loaded.reshape(dst.shape)
    dim = getattr(attrs, "tp_dim", None)
    world = getattr(attrs, "world", None)
    rows, cols = getattr(attrs, "reblock", (1, 1))
    if (rows, cols) != (1, 1) and dim is not None:
        # replicate each shipped scale over the finer blocks, then crop the ceil grid to this world's size
        loaded = loaded.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        loaded = loaded.narrow(dim, 0, dst.shape[dim] * world.size)
    if dim is not None and world is not None and world.size > 1:
        if loaded.shape[dim] != dst.shape[dim] * world.size:
            raise WeightShapeError(
                f"shape {list(loaded.shape)} cannot be split into {world.size} block-aligned parts of "
                f"{list(dst.shape)} along dim {dim}"
            )
        loaded = narrow_for_rank(loaded, dim, world)
    if tuple(loaded.shape) != tuple(dst.shape):
        raise WeightShapeError(f"shape {list(loaded.shape)} does not match the expected {list(dst.shape)}")
    with torch.no_grad():
        dst.copy_(loaded)


def is_e8m0(fmt: QuantFormat) -> bool:
    return getattr(fmt, "scale_format", None) == "e8m0" or getattr(fmt, "scale_kind", None) == "e8m0"


def make_param(fmt: QuantFormat, suffix: str, shape: tuple[int, ...], dim: int | None, world: Any,
               lead: tuple[int, ...] = (), reblock: tuple[int, int] = (1, 1)) -> nn.Parameter:
    """An empty parameter for stored tensor ``suffix`` (``lead``: stacking dims such as experts;
    ``reblock``: scale replication factors from ``reblock_for_tp``)."""
    param = nn.Parameter(torch.empty(*lead, *shape, dtype=storage_dtype(fmt, suffix, shape)), requires_grad=False)
    scalar = len(shape) == 1 and shape[0] == 1
    is_scale = suffix == getattr(fmt, "scale_name", None)
    set_weight_attrs(param, tp_dim=None if scalar else dim, world=world, weight_loader=load_packed,
                     e8m0=is_e8m0(fmt) and suffix != "weight", reblock=reblock if is_scale else (1, 1))
    return param


def packed_matmul(fmt: QuantFormat, tensors: dict[str, torch.Tensor], x: torch.Tensor, shape: Shape,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)``: the Triton kernel on GPU, else decode to ``x.dtype`` and multiply (the reference)."""
    if x.is_cuda and has_kernel(fmt) and os.environ.get(TORCH_ONLY_ENV) != "1":
        y = quant_matmul(fmt, tensors, x, shape)
        return y if bias is None else y + bias
    return F.linear(x, fmt.decode(tensors, shape, x.dtype), bias)


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
            setattr(layer, suffix, make_param(self.fmt, suffix, stored, own_dim, layer.world, reblock=reblock))

    def adopt(self, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Install already-encoded tensors (a load-time conversion) in place of the layer's weight."""
        if "weight" in layer._parameters and "weight" not in tensors:
            del layer.weight
        layer.quant_method = self
        layer.quant_tensor_names = tuple(tensors)
        for suffix, t in tensors.items():
            setattr(layer, suffix, nn.Parameter(t, requires_grad=False))

    def tensors(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        return {name: getattr(layer, name) for name in layer.quant_tensor_names}

    def dense_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The decoded [out_local, in_local] weight (reference path; also what a dense reference is given)."""
        return self.fmt.decode(self.tensors(layer), self.local_shape(layer), dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and bias is None:  # canonical rows through the decode GEMV (dgpp.quant.exact_rows)
            from dgpp.quant.exact_rows import routed_packed_linears

            routed = routed_packed_linears((layer,), x)
            if routed is not None:
                return routed[0]
        return packed_matmul(self.fmt, self.tensors(layer), x, self.local_shape(layer), bias)


def layer_tensors(layers: tuple[nn.Module, ...]) -> tuple[list[dict[str, torch.Tensor]], list[Shape]]:
    """The packed tensors and local [N, K] shape of each layer."""
    return ([layer.quant_method.tensors(layer) for layer in layers],
            [layer.quant_method.local_shape(layer) for layer in layers])


def shared_decode_format(layers: tuple[nn.Module, ...], x: torch.Tensor, on_gpu: bool) -> QuantFormat | None:
    """The format of ``layers`` when all hold packed weights of one format, none has a bias, and the
    packed decode GEMV takes ``x`` (a GPU, 1..16 rows): then they can share one launch. Else None."""
    methods = [layer.quant_method for layer in layers]
    if not all(isinstance(m, QuantLinearMethod) for m in methods) or any(layer.bias is not None for layer in layers):
        return None
    fmt = methods[0].fmt
    if any(m.fmt != fmt for m in methods) or os.environ.get(TORCH_ONLY_ENV) == "1":
        return None
    tensor_sets, shapes = layer_tensors(layers)
    return fmt if decode_gemv_applies(fmt, tensor_sets, x, shapes, on_gpu) else None


def fused_packed_linear(layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[layer(x) for layer in layers]`` (1..3 packed layers, e.g. q/k/v) in one decode GEMV launch, or
    None when ``shared_decode_format`` says they cannot share one."""
    if x.is_cuda:  # canonical rows through the decode GEMV whatever the step's row count
        from dgpp.quant.exact_rows import routed_packed_linears

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
        from dgpp.quant.exact_rows import routed_packed_gate_up_silu

        routed = routed_packed_gate_up_silu(gate, up, x)
        if routed is not None:
            return routed
    fmt = shared_decode_format((gate, up), x, on_gpu=x.is_cuda)
    if fmt is None or gate.quant_method.local_shape(gate) != up.quant_method.local_shape(up):
        return None
    return quant_gate_up_silu(fmt, gate.quant_method.tensors(gate), up.quant_method.tensors(up), x,
                              gate.quant_method.local_shape(gate))
