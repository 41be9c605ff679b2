"""A MiMo-V2.6 checkpoint as the ``mimo_v2_flash`` model reads it: tensor names and formats.

``V26Reader`` is a ``CheckpointReader`` whose names are transformers' ``mimo_v2_flash`` names: each fused
``self_attn.qkv_proj`` (main layers and MTP layers) appears as ``q_proj`` / ``k_proj`` / ``v_proj`` with their
codes and re-blocked scales (``dgpp_mimo.qkv_layout``), and the vision / audio towers the release bundles are
not there at all (one log line says how many tensors were skipped). Everything else passes through.

``V26Scheme`` says which format each module is stored in, from the config alone (so the memory plan can
build the model on ``meta``) and, given the tensor names, checked against them: FP8 E4M3 with 128x128 F32
``weight_scale_inv`` on the dense projections (q/k/v at their split blocks), MXFP4 (E2M1 + an E8M0
``weight_scale`` per 32) on the routed experts, and BF16 for ``o_proj``, the router, ``eh_proj``, the
embedding and the head. A projection the config says is FP8 but that ships without its scale is dense. In the
``split`` projection layout q/k/v ship as separate matrices with grids of their own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dgpp.log import get_logger
from dgpp.plugin_api import CheckpointError, CheckpointReader
from dgpp.quant.format import QuantFormat
from dgpp.quant.fp4 import MXFP4
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.scheme import QuantScheme
from dgpp_mimo.qkv_layout import PARTS, FusedQKV
from dgpp_mimo.v26_config import SLIDING

log = get_logger("dgpp_mimo")
# what the release bundles beside the language model; dgpp serves text only
AUX_PREFIXES = (
    "visual.",
    "audio_encoder.",
    "speech_embeddings.",
    "audio_projector.",
    "model.visual.",
    "model.audio_encoder.",
)
FP8_SCALE = "weight_scale_inv"
_ATTN = re.compile(r"^(model\.(?:mtp\.)?layers\.(\d+))\.self_attn\.")
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
_FP8_DENSE = re.compile(r"\.(mlp\.(gate|up|down)_proj|self_attn\.(q|k|v|qkv)_proj)$")
# the modules V26Scheme leaves BF16 (o_proj, eh_proj: every one that is no FP8 projection; routed experts are
# MXFP4 whatever an ignore list says), as one quantization_config ignore entry
RELEASE_BF16 = f"re:(?!.*{_FP8_DENSE.pattern})"


def qkv_geometry(canonical: dict[str, Any], quant: dict[str, Any] | None, module: str) -> FusedQKV:
    """The fused projection of ``module``'s layer (``model.layers.i`` or ``model.mtp.layers.k``, which is
    a sliding-window layer); ``quant`` is the release's ``quantization_config``."""
    match = _ATTN.match(module + ".self_attn.")
    if match is None:
        raise ValueError(f"{module} is not an attention layer")
    sliding = ".mtp." in module or canonical["layer_types"][int(match.group(2))] == SLIDING
    kv = canonical["num_key_value_heads"]
    return FusedQKV.of(
        canonical["num_attention_heads"],
        2 * kv if sliding else kv,
        canonical["head_dim"],
        canonical["v_head_dim"],
        chunks=kv,
        block=fp8_block(quant),
    )


def fp8_block(quant: dict[str, Any] | None) -> tuple[int, int]:
    block = (quant or {}).get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def _mxfp4_group(quant: dict[str, Any] | None) -> int:
    return int((quant or {}).get("mxfp4_block_size") or 32)


class V26Scheme(QuantScheme):
    """``format_for`` by module name (see the module docstring). ``quant``: the release's
    ``quantization_config`` (None: a BF16 checkpoint); ``names``: the checkpoint's tensors as ``V26Reader``
    shows them, or None to trust the config; ``fused``: q/k/v come split from one ``qkv_proj``."""

    def __init__(
        self,
        canonical: dict[str, Any],
        quant: dict[str, Any] | None,
        names: Iterable[str] | None = None,
        fused: bool = True,
    ) -> None:
        super().__init__("mimo_v2")
        self.canonical = canonical
        self.quant = quant
        self.names = None if names is None else set(names)
        self.fused = fused

    def _stored(self, module: str, suffix: str) -> bool:
        return self.names is None or f"{module}.{suffix}" in self.names

    def format_for(self, module: str) -> QuantFormat | None:
        if self.quant is None:
            return None
        if _EXPERT.search(module):
            return MXFP4(group=_mxfp4_group(self.quant)) if self._stored(module, "weight_scale") else None
        match = _FP8_DENSE.search(module)
        if match is None or not self._stored(module, FP8_SCALE):
            return None
        part = module.rsplit(".", 1)[1]
        if part in PARTS and self.fused:
            layout = qkv_geometry(self.canonical, self.quant, module.rsplit(".self_attn", 1)[0])
            return FP8Block(block=layout.part_block(part))
        return FP8Block(block=fp8_block(self.quant))


@dataclass(frozen=True)
class _Split:
    """A split name: the fused tensor it comes from, its layout and which part / which tensor it is."""

    fused_module: str
    layout: FusedQKV
    part: str
    suffix: str

    @property
    def fused_name(self) -> str:
        return f"{self.fused_module}.{self.suffix}"


class V26Reader(CheckpointReader):
    """The checkpoint at ``checkpoint_dir`` under ``mimo_v2_flash`` names (see the module docstring)."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        canonical: dict[str, Any],
        quant: dict[str, Any] | None,
        fused: bool = True,
    ) -> None:
        super().__init__(checkpoint_dir)
        aux = [n for n in self.file_of if n.startswith(AUX_PREFIXES)]
        if aux:
            log.info("vision / audio tensors skipped (text only)", tensors=len(aux), first=aux[0])
        for name in aux:
            del self.file_of[name]
        self.split: dict[str, _Split] = {}
        self._fused_file: dict[str, Path] = {}
        if fused:
            self._map_fused(canonical, quant)

    def _map_fused(self, canonical: dict[str, Any], quant: dict[str, Any] | None) -> None:
        for name in [n for n in self.file_of if n.endswith(".self_attn.qkv_proj.weight")]:
            module = name[: -len(".weight")]
            layout = qkv_geometry(canonical, quant, module[: -len(".self_attn.qkv_proj")])
            suffixes = ("weight", FP8_SCALE) if f"{module}.{FP8_SCALE}" in self.file_of else ("weight",)
            base = module[: -len("qkv_proj")]
            for suffix in suffixes:
                self._fused_file[f"{module}.{suffix}"] = self.file_of.pop(f"{module}.{suffix}")
                for part in PARTS:
                    self.split[f"{base}{part}.{suffix}"] = _Split(module, layout, part, suffix)

    def names(self) -> list[str]:
        return sorted([*self.file_of, *self.split])

    def __contains__(self, name: str) -> bool:
        return name in self.file_of or name in self.split

    def where(self, name: str) -> str:
        split = self.split.get(name)
        if split is None:
            return super().where(name)
        return f"{self._fused_file[split.fused_name]} ({split.fused_name})"

    def _fused(self, split: _Split) -> torch.Tensor:
        return self._open(self._fused_file[split.fused_name]).get_tensor(split.fused_name)

    def _split_tensor(self, split: _Split) -> torch.Tensor:
        fused = self._fused(split)
        try:
            if split.suffix == FP8_SCALE:
                return split.layout.split_scales(fused, split.part)
            return split.layout.split_rows(fused, split.part)
        except CheckpointError as e:
            raise CheckpointError(
                f"tensor {split.fused_name} in {self._fused_file[split.fused_name]}: {e}"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        split = self.split.get(name)
        if split is None:
            return super().shape(name)
        cols = self._open(self._fused_file[split.fused_name]).get_slice(split.fused_name).get_shape()[1]
        rows = split.layout.part_rows(split.part)
        if split.suffix == FP8_SCALE:
            rows //= split.layout.part_block(split.part)[0]
        return rows, cols

    def dtype(self, name: str) -> torch.dtype:
        split = self.split.get(name)
        return super().dtype(split.fused_name if split else name)

    def get(self, name: str) -> torch.Tensor:
        split = self.split.get(name)
        return super().get(name) if split is None else self._split_tensor(split)

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        split = self.split.get(name)
        if split is None:
            return super().get_part(name, dim, start, length)
        return self._split_tensor(split).narrow(dim, start, length)
