"""The weight-format contract: what a packed format must say about its tensors, values and bytes."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from dgpp.errors import CheckpointError

Shape = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class QuantFormat(ABC):
    """A weight format as shipped in a checkpoint, for a 2-D linear weight of logical shape [N, K] (out, in).

    Subclasses are frozen dataclasses whose fields are the format's parameters (block size, bits, group);
    ``with_params`` makes a configured copy. ``tensor_shapes`` names each stored tensor (the suffix after the
    module prefix, e.g. ``weight_scale_inv``) and its shape; ``decode`` turns them into the exact values the
    format defines, rounded once to ``dtype``; ``packed_bytes`` is what a resident copy costs.
    """

    name: ClassVar[str]

    def with_params(self, **params) -> QuantFormat:
        return dataclasses.replace(self, **params)

    @abstractmethod
    def tensor_shapes(self, shape: Shape) -> dict[str, tuple[int, ...]]:
        """Required stored tensors (suffix -> shape) for a weight of logical shape ``shape``."""

    def optional_tensors(self) -> tuple[str, ...]:
        """Suffixes the format may carry and the loader keeps (or ignores, e.g. ``input_scale``)."""
        return ()

    @abstractmethod
    def decode(self, tensors: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """The dense [N, K] weight in ``dtype`` (the torch reference path)."""

    def packed_bytes(self, shape: Shape) -> int:
        """Bytes of the stored tensors for a weight of ``shape`` (itemized by ``tensor_shapes``)."""
        return sum(_numel(s) * self.tensor_itemsize(name) for name, s in self.tensor_shapes(shape).items())

    @abstractmethod
    def tensor_itemsize(self, name: str) -> int:
        """Bytes per element of stored tensor ``name`` (its widest accepted dtype)."""

    def prepare(self, tensors: dict[str, torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
        """Tensors as the kernels want them (default: as shipped). Must not lose information."""
        return tensors

    def row_slice(
        self, tensors: dict[str, torch.Tensor], shape: Shape, start: int, stop: int
    ) -> dict[str, torch.Tensor] | None:
        """The stored tensors of output rows ``start:stop`` (views), or None when the format's layout cannot
        be cut there (callers then decode the whole weight). Default: None."""
        return None

    def check(self, tensors: dict[str, torch.Tensor], shape: Shape, where: str) -> None:
        """Raise ``CheckpointError`` naming the tensor when one is missing or mis-shaped."""
        for suffix, want in self.tensor_shapes(shape).items():
            t = tensors.get(suffix)
            if t is None:
                raise CheckpointError(f"{where}.{suffix}: missing (format {self.name} needs it)")
            got = tuple(t.shape)
            if got != tuple(want) and not (_numel(want) == 1 and t.numel() == 1):
                raise CheckpointError(
                    f"{where}.{suffix}: shape {list(got)} does not match {list(want)} "
                    f"for format {self.name} and weight shape {list(shape)}"
                )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
