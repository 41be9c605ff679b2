"""Integer weights packed into int32 words: compressed-tensors pack-quantized and GPTQ / AutoRound."""

from __future__ import annotations

import dataclasses

import torch

from dgpp.errors import CheckpointError
from dgpp.quant.codecs import unpack_int32
from dgpp.quant.format import QuantFormat, Shape


def _check_bits(name: str, bits: int) -> None:
    if bits not in (2, 4, 8):
        raise CheckpointError(f"format {name}: {bits}-bit codes are not supported (2, 4 or 8)")


def check_declared_shape(tensors: dict[str, torch.Tensor], shape: Shape, where: str) -> None:
    """A shipped ``weight_shape`` must name the module's logical ``[N, K]``."""
    declared = tensors.get("weight_shape")
    if declared is not None and [int(v) for v in declared.tolist()] != list(shape):
        raise CheckpointError(
            f"{where}.weight_shape: {declared.tolist()} does not match the module's {list(shape)}"
        )


@dataclasses.dataclass(frozen=True)
class WordPacked(QuantFormat):
    """Codes packed in int32 words beside a 2-byte scale per group, with an optional shipped ``weight_shape``
    (compressed-tensors ``pack-quantized`` and the NF4I8 codebook indices)."""

    def optional_tensors(self) -> tuple[str, ...]:
        return ("weight_shape",)

    def tensor_itemsize(self, name: str) -> int:
        return 2 if name == "weight_scale" else 4

    def check(self, tensors: dict[str, torch.Tensor], shape: Shape, where: str) -> None:
        super().check(tensors, shape, where)
        check_declared_shape(tensors, shape, where)


@dataclasses.dataclass(frozen=True)
class IntPacked(WordPacked):
    """compressed-tensors ``pack-quantized``, symmetric: ``weight_packed`` I32 [N, K·b/32] (codes along K,
    lowest bits first), ``weight_scale`` [N, K/group] (BF16 as shipped), ``weight_shape`` I64 [2].

    Codes are stored offset by 2^(b−1): value = round_to_dtype((code − 2^(b−1)) × scale[n, k // group]).
    ``group`` 0 means one scale per row (the ``channel`` strategy).
    """

    name = "int_packed"
    bits: int = 4
    group: int = 64

    def group_size(self, shape: Shape) -> int:
        return self.group or shape[1]

    def tensor_shapes(self, shape: Shape) -> dict[str, tuple[int, ...]]:
        _check_bits(self.name, self.bits)
        n, k = shape
        g = self.group_size(shape)
        if (k * self.bits) % 32 or k % g:
            raise CheckpointError(
                f"format {self.name}: in_features {k} must fill int32 words and groups of {g}"
            )
        return {"weight_packed": (n, k * self.bits // 32), "weight_scale": (n, k // g)}

    def decode(self, tensors: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_int32(tensors["weight_packed"], self.bits, dim=1)[:, : shape[1]]
        centered = (codes - (1 << (self.bits - 1))).to(torch.float32)
        scale = tensors["weight_scale"].to(torch.float32).repeat_interleave(self.group_size(shape), dim=1)
        return (centered * scale).to(dtype)


@dataclasses.dataclass(frozen=True)
class GPTQ(QuantFormat):
    """GPTQ / AutoRound (GPTQ layout) ``bits``-bit weights with per-group F16 scales, stored transposed:

    ``qweight`` I32 [K·b/32, N] (codes along K), ``qzeros`` I32 [K/group, N·b/32] (zero points along N),
    ``scales`` F16 [K/group, N], optional ``g_idx`` I32 [K] (the group of each input column).
    value[n, k] = round_to_dtype((code − (zero + zero_offset)) × scale) with group g = g_idx[k] (k // group
    without g_idx). ``zero_offset`` is 1 for the original GPTQ layout (``checkpoint_format: gptq``, zeros
    stored minus one; symmetric 4-bit zeros read 7 → 8 = 2^(b−1)) and 0 for ``gptq_v2``. Act-order
    (``desc_act``: a permuted g_idx) is supported on both paths by gathering scales through g_idx.
    """

    name = "gptq"
    bits: int = 4
    group: int = 128
    zero_offset: int = 1

    def group_size(self, shape: Shape) -> int:
        return self.group if self.group > 0 else shape[1]

    def tensor_shapes(self, shape: Shape) -> dict[str, tuple[int, ...]]:
        _check_bits(self.name, self.bits)
        n, k = shape
        g = self.group_size(shape)
        if (k * self.bits) % 32 or (n * self.bits) % 32 or k % g:
            raise CheckpointError(
                f"format {self.name}: shape {list(shape)} must fill int32 words and groups of {g}"
            )
        return {
            "qweight": (k * self.bits // 32, n),
            "qzeros": (k // g, n * self.bits // 32),
            "scales": (k // g, n),
        }

    def optional_tensors(self) -> tuple[str, ...]:
        return ("g_idx",)

    def tensor_itemsize(self, name: str) -> int:
        return 2 if name == "scales" else 4

    def group_index(self, tensors: dict[str, torch.Tensor], shape: Shape) -> torch.Tensor:
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            return g_idx.to(torch.int64)
        return torch.arange(shape[1], device=tensors["qweight"].device) // self.group_size(shape)

    def zeros(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Zero points [K/group, N] including ``zero_offset``."""
        return unpack_int32(tensors["qzeros"], self.bits, dim=1) + self.zero_offset

    def decode(self, tensors: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_int32(tensors["qweight"], self.bits, dim=0)  # [K, N]
        groups = self.group_index(tensors, shape)
        zeros = self.zeros(tensors)[groups]
        scales = tensors["scales"].to(torch.float32)[groups]
        return ((codes - zeros).to(torch.float32) * scales).t().contiguous().to(dtype)

    def prepare(self, tensors: dict[str, torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
        # A g_idx equal to k // group carries no information; dropping it saves the kernel a gather.
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            trivial = torch.arange(shape[1], device=g_idx.device) // self.group_size(shape)
            if torch.equal(g_idx.to(torch.int64), trivial):
                return {k: v for k, v in tensors.items() if k != "g_idx"}
            return {**tensors, "g_idx": g_idx.to(torch.int32)}
        return tensors
