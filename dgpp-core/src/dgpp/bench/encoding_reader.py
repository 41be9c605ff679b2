"""A checkpoint that exists only in memory: the packed tensors a release would store, encoded from a dense model on
its device when the loader first asks for them (``dgpp bench --quant``).

The names are the checkpoint names the family's loader asks for (its ``rename`` applied to the module-side names):
a packed linear's ``<module>.<suffix>`` (``weight_packed``, ``weight_scale`` ...), a routed expert's
``<experts>.<e>.<proj>.<suffix>`` (one per expert, as releases ship them), everything else the dense tensor as is.
A routed expert's dense values are a view of the source's stacked ``gate_up_proj [E, 2I, H]`` /
``down_proj [E, H, I]``, so no dense copy is made; the encodings of one group (a linear, or one projection of every
expert of a layer) are kept until a tensor of another group is asked for, so each weight is encoded once and at
most one group's packed tensors are held beside the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgpp.bench.step_bytes import packed_experts, quantized_linears
from dgpp.quant.encode import encode
from dgpp.quant.format import QuantFormat
from dgpp.quant.moe import PROJECTIONS


@dataclass(frozen=True)
class PackedSource:
    """One packed weight: its format, its dense ``[out, in]`` values (a view of the source model's tensor) and
    the group its encoding is kept with."""

    fmt: QuantFormat
    dense: torch.Tensor
    group: str


def packed_sources(model: torch.nn.Module, source: dict[str, torch.Tensor]) -> dict[str, PackedSource]:
    """Module-side name (``<linear>`` or ``<experts>.<e>.<proj>``) -> its ``PackedSource`` for every packed weight
    of ``model``, its dense values taken from ``source`` (the dense model's parameters, same module names)."""
    out: dict[str, PackedSource] = {}
    for name, layer in quantized_linears(model).items():
        out[name] = PackedSource(layer.quant_method.fmt, source[f"{name}.weight"], name)
    for name, experts in packed_experts(model).items():
        gate_up, down = source[f"{name}.gate_up_proj"], source[f"{name}.down_proj"]
        inter = experts.inter
        for proj in PROJECTIONS:
            fmt = getattr(experts, proj).fmt
            for e in range(experts.num_experts):
                if proj == "down_proj":
                    dense = down[e]
                else:  # gate rows first, then up rows (the fused layout)
                    dense = gate_up[e, :inter] if proj == "gate_proj" else gate_up[e, inter:]
                out[f"{name}.{e}.{proj}"] = PackedSource(fmt, dense, f"{name}.{proj}")
    return out


def unpacked_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` outside its packed linears and packed expert stacks (a release stores these
    as they are)."""
    owners = tuple(f"{name}." for name in (*quantized_linears(model), *packed_experts(model)))
    return {name: p for name, p in model.named_parameters() if not name.startswith(owners)}


class EncodingReader:
    """A ``CheckpointReader`` stand-in (module doc): ``dense`` tensors served as they are, ``packed`` weights
    encoded on demand, every name under ``rename`` (module-side -> checkpoint name)."""

    def __init__(
        self,
        dense: dict[str, torch.Tensor],
        packed: dict[str, PackedSource],
        rename: Callable[[str], str],
        label: str,
    ) -> None:
        self.dense = dense
        self.packed = packed
        self.dir = f"<{label} encoded in memory>"
        # checkpoint name -> (module-side key, stored suffix; None for a dense tensor)
        self.tensors: dict[str, tuple[str, str | None]] = {rename(n): (n, None) for n in dense}
        for key, src in packed.items():
            for suffix in src.fmt.tensor_shapes(tuple(src.dense.shape)):
                self.tensors[rename(f"{key}.{suffix}")] = (key, suffix)
        self._group = ""
        self._encoded: dict[str, dict[str, torch.Tensor]] = {}

    def _encoding(self, key: str) -> dict[str, torch.Tensor]:
        src = self.packed[key]
        if src.group != self._group:
            self._encoded = {}  # free the previous group's tensors first
            self._group = src.group
        if key not in self._encoded:
            self._encoded[key] = encode(src.fmt, src.dense.float())
        return self._encoded[key]

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def where(self, name: str) -> str:
        return self.dir

    def searched(self) -> str:
        return self.dir

    def get(self, name: str) -> torch.Tensor:
        key, suffix = self.tensors[name]
        return self.dense[key] if suffix is None else self._encoding(key)[suffix]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        return self.get(name).narrow(dim, start, length)
