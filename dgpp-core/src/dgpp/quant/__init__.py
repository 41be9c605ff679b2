"""Weight formats as shipped: exact decode to a reference, packed linears, Triton kernels, byte counts."""

from __future__ import annotations

from dgpp.quant.format import QuantFormat, Shape
from dgpp.quant.registry import builtin_formats, get_format, registered_formats


def packed_bytes(fmt: QuantFormat | str, shape: Shape) -> int:
    """Resident bytes of a weight of logical ``shape`` [out, in] stored in ``fmt`` (for the memory plan)."""
    if isinstance(fmt, str):
        fmt = get_format(fmt)
    return fmt.packed_bytes(tuple(shape))


__all__ = ["QuantFormat", "Shape", "builtin_formats", "get_format", "packed_bytes", "registered_formats"]
