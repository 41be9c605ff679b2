"""A packed layer's parameters: one per stored tensor, with its resident dtype, how tensor parallelism slices it
(scale blocks re-blocked where a rank's slice needs it) and the weight loader that copies a shipped tensor in."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dgpp.nn.weights import WeightShapeError, narrow_for_rank, set_weight_attrs
from dgpp.quant.codecs import scale_to_float
from dgpp.quant.format import QuantFormat, Shape
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import GPTQ


def storage_dtype(fmt: QuantFormat, suffix: str, shipped: tuple[int, ...]) -> torch.dtype:
    """Resident dtype of a stored tensor: codes keep their bytes; float scales start as float32, which
    holds E8M0 exactly, and 2-byte scales switch to their shipped dtype when they load."""
    if isinstance(fmt, FP8Block):
        return torch.float8_e4m3fn if suffix == "weight" else torch.float32
    if isinstance(fmt, FP4Grouped):
        return torch.float32 if suffix == fmt.global_name else torch.uint8
    if suffix in ("weight_packed", "weight_indices", "qweight", "qzeros", "g_idx"):
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


def reblock_for_tp(
    fmt: QuantFormat, local: Shape, parallel: str, world_size: int
) -> tuple[QuantFormat, tuple[int, int]]:
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
    if (
        param.dtype == torch.float32
        and loaded.dtype in (torch.bfloat16, torch.float16)
        and shard in (None, 0)
    ):
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


def make_param(
    fmt: QuantFormat,
    suffix: str,
    shape: tuple[int, ...],
    dim: int | None,
    world: Any,
    lead: tuple[int, ...] = (),
    reblock: tuple[int, int] = (1, 1),
) -> nn.Parameter:
    """An empty parameter for stored tensor ``suffix`` (``lead``: stacking dims such as experts;
    ``reblock``: scale replication factors from ``reblock_for_tp``)."""
    param = nn.Parameter(
        torch.empty(*lead, *shape, dtype=storage_dtype(fmt, suffix, shape)), requires_grad=False
    )
    scalar = len(shape) == 1 and shape[0] == 1
    is_scale = suffix == getattr(fmt, "scale_name", None)
    set_weight_attrs(
        param,
        tp_dim=None if scalar else dim,
        world=world,
        weight_loader=load_packed,
        e8m0=is_e8m0(fmt) and suffix != "weight",
        reblock=reblock if is_scale else (1, 1),
    )
    if param.dtype == torch.float32 and fmt.tensor_itemsize(suffix) == 2:
        # a format whose scales ship in 2 bytes: load_packed keeps them as shipped, so a plan built on meta
        # counts 2 bytes an element, not the float32 placeholder's 4 (dgpp.quant.resident)
        param.loaded_itemsize = 2
    return param
