"""Putting formats into a built model: per-module swaps before loading, explicit conversions after.

``quantize_modules`` (before ``load_weights``) gives every ``Linear`` / ``FusedExperts`` whose checkpoint
name the ``quantization_config`` resolves to a format the packed parameters of that format, so the
checkpoint loads as shipped. ``convert_dense_weights`` (after loading) applies the engine's explicit
load-time conversions, each logged at startup: ``engine.dense_weights: fp8`` (lossy: dense projections
to block-128 E4M3) and ``engine.bf16_weights: bf12 | bf12+bf16`` (lossless). Both are off by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError
from dgpp.log import get_logger
from dgpp.nn.linear import Linear, UnquantizedLinearMethod
from dgpp.nn.moe import FusedExperts
from dgpp.quant.bf12 import BF12, encode_bf12
from dgpp.quant.encode import encode_fp8_block
from dgpp.quant.format import QuantFormat
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.linear import QuantLinearMethod, decoded_matmul
from dgpp.quant.moe import PROJECTIONS, QuantExperts
from dgpp.quant.scheme import QuantScheme

log = get_logger("dgpp.quant")
BF12_MAX_ROWS = 8  # decode launches; larger batches (prefill) use the bf16 copy under bf12+bf16


def _checkpoint_name(module_name: str, rename: Callable[[str], str]) -> str:
    return rename(module_name + ".weight")[: -len(".weight")]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _expert_formats(scheme: QuantScheme, ckpt: str, num_experts: int) -> dict[str, QuantFormat] | None:
    """Each projection's format for the experts of ``ckpt`` (None: all dense). A projection may differ from
    the others (per-projection exports); within a projection every expert must agree, and no projection
    may be dense while another is packed."""
    formats: dict[str, QuantFormat | None] = {}
    for proj in PROJECTIONS:
        fmts = {scheme.format_for(f"{ckpt}.{e}.{proj}") for e in (0, num_experts - 1)}
        if len(fmts) != 1:
            raise ConfigError(
                f"quantization_config: the experts of {ckpt} resolve to mixed formats for {proj} "
                f"({sorted(f.name if f else 'dense' for f in fmts)}), which is not supported"
            )
        formats[proj] = fmts.pop()
    if all(f is None for f in formats.values()):
        return None
    if any(f is None for f in formats.values()):
        raise ConfigError(
            f"quantization_config: the experts of {ckpt} are packed for some projections and dense for "
            f"others ({ {p: f.name if f else 'dense' for p, f in formats.items()} }), which is not supported"
        )
    return {p: f for p, f in formats.items() if f is not None}


def quantize_modules(
    model: nn.Module,
    hf_config: dict[str, Any],
    *,
    rename: Callable[[str], str] = lambda n: n,
    scheme: QuantScheme | None = None,
) -> QuantScheme | None:
    """Swap in packed parameters for every module the checkpoint stores quantized; returns the scheme.
    ``scheme`` (default: ``hf_config``'s ``quantization_config``) is for a family whose release says where
    each format goes in keys of its own."""
    scheme = scheme if scheme is not None else QuantScheme.from_hf_config(hf_config)
    if scheme is None:
        return None
    counts: dict[str, int] = {}
    for name, module in list(model.named_modules()):
        ckpt = _checkpoint_name(name, rename)
        if isinstance(module, Linear) and isinstance(module.quant_method, UnquantizedLinearMethod):
            fmt = scheme.format_for(ckpt)
            if fmt is None:
                continue
            dtype = module.weight.dtype
            del module.weight
            module.quant_method = QuantLinearMethod(fmt, act_order=scheme.act_order)
            module.quant_method.create_weights(module, dtype)
        elif isinstance(module, FusedExperts):
            formats = _expert_formats(scheme, ckpt, module.num_experts)
            if formats is None:
                continue
            hidden = module.down_proj.shape[1]
            _replace(
                model,
                name,
                QuantExperts(
                    formats,
                    module.num_experts,
                    hidden,
                    module.inter * module.world.size,
                    world=module.world,
                    swiglu_limit=module.swiglu_limit,
                ),
            )
            fmt = formats["gate_proj"]
            for proj in ("up_proj", "down_proj"):  # a layer that mixes formats counts each one it holds
                if formats[proj] != fmt:
                    counts[formats[proj].name] = counts.get(formats[proj].name, 0) + 1
        else:
            continue
        counts[fmt.name] = counts.get(fmt.name, 0) + 1
    log.info("quantized modules", method=scheme.method, modules=counts)
    return scheme


class DualMethod:
    """``bf12+bf16``: the packed bf12 copy serves decode-sized launches, the bf16 weight serves prefill."""

    def __init__(self, packed: QuantLinearMethod) -> None:
        self.packed = packed

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        raise RuntimeError("DualMethod is installed on loaded layers only")

    def row_block(self, layer: nn.Module, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return decoded_matmul(x, layer.weight[start:stop])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.reshape(-1, x.shape[-1]).shape[0] <= BF12_MAX_ROWS:
            return self.packed.apply(layer, x, bias)
        return decoded_matmul(x, layer.weight, bias)


def convert_dense_weights(model: nn.Module, engine: EngineConfig) -> dict[str, int]:
    """Apply ``engine.dense_weights`` / ``engine.bf16_weights`` to loaded dense Linears; logs what it did."""
    dense, bf16 = engine.dense_weights, engine.bf16_weights
    done = {"fp8": 0, "bf12": 0, "kept_bf16": 0}
    if dense == "checkpoint" and bf16 == "checkpoint":
        return done
    fp8 = FP8Block(block=(128, 128))
    for _, module in model.named_modules():
        if not (isinstance(module, Linear) and isinstance(module.quant_method, UnquantizedLinearMethod)):
            continue
        weight = module.weight.data
        if dense == "fp8" and weight.dtype.is_floating_point:
            QuantLinearMethod(fp8).adopt(module, encode_fp8_block(weight.float(), fp8))
            done["fp8"] += 1
        elif bf16 != "checkpoint" and weight.dtype == torch.bfloat16 and weight.shape[1] % 1024 == 0:
            packed = encode_bf12(weight)
            if packed is None:
                done["kept_bf16"] += 1
                continue
            method = QuantLinearMethod(BF12())
            keep_dense = bf16 == "bf12+bf16"
            method.adopt(module, packed)
            if keep_dense:
                module.weight = nn.Parameter(weight, requires_grad=False)
                module.quant_method = DualMethod(method)
            done["bf12"] += 1
    if dense == "fp8":
        log.warning(
            "engine.dense_weights=fp8: dense projections re-encoded to block-128 E4M3 at load (lossy)",
            converted=done["fp8"],
        )
    if bf16 != "checkpoint":
        log.info(
            f"engine.bf16_weights={bf16}: BF16 matrices packed to bf12 (lossless)",
            packed=done["bf12"],
            kept_bf16=done["kept_bf16"],
        )
    return done
