"""What a packed-weight launch hands its kernel for a format's tensors, shared by the MMA decode GEMV
(``decode_launch``), the row GEMV (``row_launch``) and the weight-only GEMM (``launch``)."""

from __future__ import annotations

import os

import torch

from dgpp.quant.format import QuantFormat, Shape
from dgpp.quant.fp8 import FP8Block


def interpreting() -> bool:
    """Triton's CPU interpreter is on (its own variable): kernels then take their portable branches."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def scale_block(fmt: QuantFormat, shape: Shape) -> tuple[int, int]:
    if isinstance(fmt, FP8Block):
        return fmt.block_for(shape)
    return (1, fmt.group)


def operand(fmt: QuantFormat, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as uint8, scales, global scale or the scales again as a placeholder)."""
    if isinstance(fmt, FP8Block):
        s = t[fmt.scale_name]
        return t["weight"].view(torch.uint8), s, s
    s = t[fmt.scale_name].view(torch.uint8)
    g = t[fmt.global_name] if fmt.global_name else s
    if fmt.global_name and g.dtype != torch.float32:
        g = g.to(torch.float32)
    return t[fmt.data_name].view(torch.uint8), s, g
