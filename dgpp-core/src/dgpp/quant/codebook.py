"""NF4I8: 4-bit indices into a fixed 16-level int8 codebook under a 32-wide Hadamard rotation of the input.

The routed experts of ``HawkBearPig/GLM-5.3-NF4I8-GPTQ-H32-g128`` (``quant_method: dgpp_nf4i8``, as the original
engine defines it): ``weight_indices`` I32 ``[N, K/8]`` (eight 4-bit indices per word, the low nibble first),
``weight_scale`` BF16 ``[N, K/128]``, optional ``weight_shape``; the weight is
``NF4I8_LEVELS[index] × scale[n, k // 128]``, exact in fp32 and rounded once to the compute dtype. The experts
were quantized in a rotated basis: the input of every rotated projection (the expert input for gate/up, the
SwiGLU output for down) is multiplied by the normalized 32-wide Sylvester Hadamard first (``hadamard32``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from dgpp.errors import CheckpointError
from dgpp.quant.codecs import unpack_int32
from dgpp.quant.format import Shape
from dgpp.quant.intq import WordPacked

# round(127 x NF4): asymmetric endpoints -127 / 127, zero at index 7
NF4I8_LEVELS = (-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127)
ROTATION_BLOCK = 32
_INV_SQRT32 = 1.0 / math.sqrt(ROTATION_BLOCK)  # multiplied into an fp32 tensor: fp32(1/√32)


@dataclasses.dataclass(frozen=True)
class NF4Codebook(WordPacked):
    """The NF4I8 weight format (see the module docstring); ``group`` inputs share a scale."""

    name: ClassVar[str] = "nf4i8"
    group: int = 128

    def tensor_shapes(self, shape: Shape) -> dict[str, tuple[int, ...]]:
        n, k = shape
        if k % self.group or k % ROTATION_BLOCK:
            raise CheckpointError(f"format {self.name}: in_features {k} must fill groups of {self.group}")
        return {"weight_indices": (n, k // 8), "weight_scale": (n, k // self.group)}

    def decode(self, tensors: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        index = unpack_int32(tensors["weight_indices"], 4, dim=1)[:, : shape[1]]
        levels = torch.tensor(NF4I8_LEVELS, dtype=torch.float32, device=index.device)[index]
        scale = tensors["weight_scale"].to(torch.float32).repeat_interleave(self.group, dim=1)
        return (levels * scale).to(dtype)


def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """Each block of 32 along the last dim times the normalized Sylvester Hadamard, in the format's op order:
    fp32 butterflies at strides 1, 2, 4, 8, 16 (below the stride bit ``x[i] + x[i^s]``, above it
    ``x[i^s] - x[i]``), times fp32(1/√32), one rounding to ``x``'s dtype."""
    shape = x.shape
    y = x.float().reshape(-1, shape[-1] // ROTATION_BLOCK, ROTATION_BLOCK)
    for stride in (1, 2, 4, 8, 16):
        pairs = y.reshape(*y.shape[:-1], ROTATION_BLOCK // (2 * stride), 2, stride)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((low + high, low - high), dim=-2).reshape(y.shape)
    return (y * _INV_SQRT32).to(x.dtype).reshape(shape)
