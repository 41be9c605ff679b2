"""Triton kernels that compute with packed weights (each checked against the torch decode path)."""

from __future__ import annotations

from dgpp.quant.kernels.decode_launch import (
    GemvTile,
    decode_gemv_applies,
    default_tile,
    quant_gate_up_silu,
    quant_multi_linear,
)
from dgpp.quant.kernels.launch import TileConfig, default_config, has_kernel, quant_matmul

__all__ = [
    "GemvTile",
    "TileConfig",
    "decode_gemv_applies",
    "default_config",
    "default_tile",
    "has_kernel",
    "quant_gate_up_silu",
    "quant_matmul",
    "quant_multi_linear",
]
