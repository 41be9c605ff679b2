"""Weight formats as shipped: exact decode to a reference, packed linears, Triton kernels, byte counts."""

from __future__ import annotations

from dgpp.quant.builtin_formats import builtin_formats
from dgpp.quant.format import QuantFormat, Shape
from dgpp.quant.registry import get_format, registered_formats
from dgpp.quant.scheme import QuantScheme


def packed_bytes(fmt: QuantFormat | str, shape: Shape) -> int:
    """Resident bytes of a weight of logical ``shape`` [out, in] stored in ``fmt`` (for the memory plan)."""
    if isinstance(fmt, str):
        fmt = get_format(fmt)
    return fmt.packed_bytes(tuple(shape))


def module_weight_bytes(scheme: QuantScheme | None, module: str, shape: Shape, dense_itemsize: int) -> int:
    """Resident bytes of linear ``module`` (checkpoint name, e.g. ``model.layers.3.mlp.experts.7.up_proj``)
    of logical ``shape``: packed bytes where ``quantization_config`` quantizes it, else dense bytes."""
    fmt = scheme.format_for(module) if scheme is not None else None
    if fmt is None:
        return shape[0] * shape[1] * dense_itemsize
    return fmt.packed_bytes(tuple(shape))


__all__ = [
    "QuantFormat",
    "QuantScheme",
    "Shape",
    "builtin_formats",
    "get_format",
    "module_weight_bytes",
    "packed_bytes",
    "registered_formats",
]
