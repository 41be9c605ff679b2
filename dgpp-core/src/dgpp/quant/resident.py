"""Resident bytes of a built module (e.g. on the ``meta`` device), with the load-time conversions of
``engine.bf16_weights`` (bf12 repacking) and ``engine.dense_weights`` (block-128 FP8): what a memory plan counts
as weights without reading a tensor."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dgpp.nn.linear import Linear, UnquantizedLinearMethod

# engine.bf16_weights: resident bytes of an eligible BF16 matrix, relative to BF16 (bf12 packs to ~0.75)
BF12_FACTOR = {"checkpoint": 1.0, "bf12": 0.75, "bf12+bf16": 1.75}


def fp8_block_bytes(rows: int, cols: int) -> int:
    """Bytes of a ``rows x cols`` matrix in ``engine.dense_weights: fp8``'s form: one E4M3 byte a value and an
    fp32 scale per 128 x 128 tile (``dgpp.quant.apply.convert_dense_weights``)."""
    return rows * cols + 4 * -(-rows // 128) * -(-cols // 128)


def resident_bytes(
    module: nn.Module,
    bf16_weights: str = "checkpoint",
    dense_weights: str = "checkpoint",
    int4pack: Mapping[int, int] | None = None,
) -> int:
    """Bytes of ``module``'s (unique) parameters as loaded, with the conversions ``engine.bf16_weights`` and
    ``engine.dense_weights`` apply to its dense Linears (FP8 first, as the load does), then
    ``engine.gguf_weights: int4pack``'s: ``int4pack`` maps ``id(weight)`` of a dense Linear the load packs to the
    bytes of its packed form (``dgpp.checkpoint.gguf_packed.planned_packing``), counted in place of the weight
    where no earlier conversion took it."""
    int4pack = int4pack or {}
    total = 0.0
    dense = [
        m.weight
        for m in module.modules()
        if isinstance(m, Linear) and isinstance(m.quant_method, UnquantizedLinearMethod)
    ]
    fp8 = {id(w): w for w in dense if dense_weights == "fp8" and w.dtype.is_floating_point}
    bf12_eligible = {id(w) for w in dense if w.dtype == torch.bfloat16 and w.shape[1] % 1024 == 0}
    for p in module.parameters():
        if id(p) in fp8:
            total += fp8_block_bytes(*p.shape)
            continue
        if id(p) in int4pack and not (bf16_weights != "checkpoint" and id(p) in bf12_eligible):
            total += int4pack[id(p)]
            continue
        # on meta, a packed scale that loads in its shipped 2-byte dtype counts 2 bytes (dgpp.quant.params)
        size = p.numel() * (
            getattr(p, "loaded_itemsize", p.element_size()) if p.is_meta else p.element_size()
        )
        total += size * (BF12_FACTOR[bf16_weights] if id(p) in bf12_eligible else 1.0)
    return int(total)
