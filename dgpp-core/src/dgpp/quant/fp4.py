"""Four-bit float weights: E2M1 pairs per byte with per-group scales (NVFP4 ModelOpt / compressed-tensors, MXFP4)."""

from __future__ import annotations

import dataclasses

import torch

from dgpp.errors import CheckpointError
from dgpp.quant.codecs import e2m1_unpack, scale_to_float
from dgpp.quant.format import QuantFormat, Shape


@dataclasses.dataclass(frozen=True)
class FP4Grouped(QuantFormat):
    """E2M1 codes packed two per byte ([N, K/2], low nibble = even column) with one scale per ``group`` columns.

    value = round_to_dtype(global_op(e2m1 × group_scale, global)), everything in fp32; e2m1 × an E4M3 or
    E8M0 scale is exact, so the only rounding before the final cast is the one global multiply/divide.
    """

    name = "fp4_grouped"
    data_name: str = "weight"
    scale_name: str = "weight_scale"
    group: int = 16
    scale_kind: str = "e4m3"  # "e4m3" (NVFP4) or "e8m0" (MXFP4)
    global_name: str | None = None
    global_op: str | None = None  # "mul" (ModelOpt weight_scale_2) or "div" (compressed-tensors global scale)

    def tensor_shapes(self, shape: Shape) -> dict[str, tuple[int, ...]]:
        n, k = shape
        if k % self.group:
            raise CheckpointError(
                f"format {self.name}: in_features {k} is not a multiple of the group size {self.group}"
            )
        out: dict[str, tuple[int, ...]] = {self.data_name: (n, k // 2), self.scale_name: (n, k // self.group)}
        if self.global_name:
            out[self.global_name] = (1,)
        return out

    def optional_tensors(self) -> tuple[str, ...]:
        return ("input_scale", "input_global_scale")

    def tensor_itemsize(self, name: str) -> int:
        return 4 if name == self.global_name else 1

    def group_scales(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return scale_to_float(tensors[self.scale_name], e8m0=self.scale_kind == "e8m0")

    def global_scale(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if not self.global_name:
            return None
        return tensors[self.global_name].to(torch.float32).reshape(())

    def row_slice(
        self, tensors: dict[str, torch.Tensor], shape: Shape, start: int, stop: int
    ) -> dict[str, torch.Tensor] | None:
        # rows are independent (codes and group scales per row; the global scale is one scalar)
        rows = slice(start, stop)
        return {
            **tensors,
            self.data_name: tensors[self.data_name][rows],
            self.scale_name: tensors[self.scale_name][rows],
        }

    def decode(self, tensors: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        values = e2m1_unpack(tensors[self.data_name])
        scaled = values * self.group_scales(tensors).repeat_interleave(self.group, dim=1)
        g = self.global_scale(tensors)
        if g is not None:
            scaled = scaled * g if self.global_op == "mul" else scaled / g
        return scaled.to(dtype)


@dataclasses.dataclass(frozen=True)
class NVFP4ModelOpt(FP4Grouped):
    """NVIDIA ModelOpt NVFP4: ``weight`` U8, ``weight_scale`` E4M3 per 16, ``weight_scale_2`` F32; e2m1·scale·scale_2."""

    name = "nvfp4_modelopt"
    global_name: str | None = "weight_scale_2"
    global_op: str | None = "mul"


@dataclasses.dataclass(frozen=True)
class NVFP4CompressedTensors(FP4Grouped):
    """compressed-tensors NVFP4: ``weight_packed``, ``weight_scale`` E4M3/16, ``weight_global_scale``; e2m1·scale / global."""

    name = "nvfp4_ct"
    data_name: str = "weight_packed"
    global_name: str | None = "weight_global_scale"
    global_op: str | None = "div"


@dataclasses.dataclass(frozen=True)
class MXFP4(FP4Grouped):
    """OCP MXFP4 (DeepSeek, MiMo experts): E2M1 pairs and an E8M0 exponent per 32: e2m1 · 2^(s−127)."""

    name = "mxfp4"
    group: int = 32
    scale_kind: str = "e8m0"
