"""Resident bytes of a built module (e.g. on the ``meta`` device), with the bf12 repacking that
``engine.bf16_weights`` applies at load: what a memory plan counts as weights without reading a tensor."""

from __future__ import annotations

import torch
from torch import nn

from dgpp.nn.linear import Linear, UnquantizedLinearMethod

# engine.bf16_weights: resident bytes of an eligible BF16 matrix, relative to BF16 (bf12 packs to ~0.75)
BF12_FACTOR = {"checkpoint": 1.0, "bf12": 0.75, "bf12+bf16": 1.75}


def resident_bytes(module: nn.Module, bf16_weights: str = "checkpoint") -> int:
    """Bytes of ``module``'s (unique) parameters as loaded, with the bf12 repacking ``engine.bf16_weights``
    applies."""
    total = 0.0
    bf12_eligible = {
        id(m.weight) for m in module.modules()
        if isinstance(m, Linear) and isinstance(m.quant_method, UnquantizedLinearMethod)
        and m.weight.dtype == torch.bfloat16 and m.weight.shape[1] % 1024 == 0
    }
    for p in module.parameters():
        # on meta, a packed scale that loads in its shipped 2-byte dtype counts 2 bytes (dgpp.quant.params)
        size = p.numel() * (getattr(p, "loaded_itemsize", p.element_size()) if p.is_meta else p.element_size())
        total += size * (BF12_FACTOR[bf16_weights] if id(p) in bf12_eligible else 1.0)
    return int(total)
