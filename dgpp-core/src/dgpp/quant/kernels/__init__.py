"""Triton kernels that compute with packed weights (each checked against the torch decode path)."""

from __future__ import annotations

from dgpp.quant.kernels.launch import TileConfig, default_config, has_kernel, quant_matmul

__all__ = ["TileConfig", "default_config", "has_kernel", "quant_matmul"]
