"""FP8 E4M3 weights: block-scaled (F32 / BF16 / E8M0 scales on a ceil grid) and per-channel."""

from __future__ import annotations

import dataclasses

import torch

from dgpp.quant.codecs import expand_blocks, fp8_e4m3_to_float, scale_to_float
from dgpp.quant.format import QuantFormat, Shape, cdiv

_SCALE_ITEMSIZE = {"f32": 4, "bf16": 2, "e8m0": 1}


@dataclasses.dataclass(frozen=True)
class FP8Block(QuantFormat):
    """``weight`` E4M3 [N, K] and a scale per ``block`` tile on a ceil grid [ceil(N/bn), ceil(K/bk)].

    value = round_to_dtype(code × scale), the product taken in fp32 (exact: 4-bit code mantissa × 8-bit
    scale mantissa). ``scale_format`` is f32 (GLM, DeepSeek V3 style), bf16 (Qwen 27B) or e8m0 (DeepSeek
    V4/V4.1: 2^(s−127)); a ``float8_e8m0fnu`` tensor is recognised whatever the field says. A shape that is
    not a block multiple (DeepSeek's 576-row projection) uses partial edge blocks.
    """

    name = "fp8_block"
    block: tuple[int, int] = (128, 128)
    scale_name: str = "weight_scale_inv"
    scale_format: str = "f32"

    def __post_init__(self) -> None:
        if self.scale_format not in _SCALE_ITEMSIZE:
            raise ValueError(
                f"fp8_block scale_format must be one of {sorted(_SCALE_ITEMSIZE)}, not {self.scale_format!r}"
            )
        object.__setattr__(self, "block", tuple(self.block))

    def scale_grid(self, shape: Shape) -> tuple[int, int]:
        return cdiv(shape[0], self.block[0]), cdiv(shape[1], self.block[1])

    def tensor_shapes(self, shape: Shape) -> dict[str, tuple[int, ...]]:
        return {"weight": tuple(shape), self.scale_name: self.scale_grid(shape)}

    def optional_tensors(self) -> tuple[str, ...]:
        return ("input_scale",)

    def tensor_itemsize(self, name: str) -> int:
        return 1 if name == "weight" else _SCALE_ITEMSIZE[self.scale_format]

    def block_for(self, shape: Shape) -> tuple[int, int]:
        """The scale tile for ``shape`` (fixed here; a whole row for the per-channel form)."""
        return self.block

    def block_scales(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scale grid as exact float32."""
        return scale_to_float(tensors[self.scale_name], e8m0=self.scale_format == "e8m0")

    def decode(self, tensors: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        scale = expand_blocks(self.block_scales(tensors), shape, self.block)
        return (fp8_e4m3_to_float(tensors["weight"]) * scale).to(dtype)

    def row_slice(
        self, tensors: dict[str, torch.Tensor], shape: Shape, start: int, stop: int
    ) -> dict[str, torch.Tensor] | None:
        bn = self.block_for(shape)[0]
        if start % bn or (stop % bn and stop != shape[0]):
            return None  # a cut inside a scale block
        grid = slice(start // bn, cdiv(stop, bn))
        return {
            **tensors,
            "weight": tensors["weight"][start:stop],
            self.scale_name: tensors[self.scale_name][grid],
        }

    def prepare(self, tensors: dict[str, torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
        # E8M0 scale grids are tiny (one byte per 32x32 or 128x128 tile): widening them to exact F32
        # once at load lets one kernel serve all three scale kinds.
        if self.scale_format == "e8m0" or tensors[self.scale_name].dtype == torch.float8_e8m0fnu:
            return {**tensors, self.scale_name: self.block_scales(tensors)}
        return tensors


@dataclasses.dataclass(frozen=True)
class FP8Channel(FP8Block):
    """``weight`` E4M3 [N, K] with one scale per output row, ``weight_scale`` [N, 1]: value = code × scale[n]."""

    name = "fp8_channel"
    scale_name: str = "weight_scale"

    def tensor_shapes(self, shape: Shape) -> dict[str, tuple[int, ...]]:
        return {"weight": tuple(shape), self.scale_name: (shape[0], 1)}

    def block_for(self, shape: Shape) -> tuple[int, int]:
        return (1, shape[1])

    def decode(self, tensors: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        scale = self.block_scales(tensors).reshape(shape[0], 1)
        return (fp8_e4m3_to_float(tensors["weight"]) * scale).to(dtype)
