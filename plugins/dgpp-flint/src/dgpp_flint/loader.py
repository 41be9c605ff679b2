"""Tensor names -> modules for the Flint family: build the model for a ``LoadContext``, give the experts the
checkpoint stores quantized their packed form (per projection, as ``quantization_config`` resolves each one),
then fill every parameter.
"""

from __future__ import annotations

import torch

from dgpp.checkpoint import CheckpointReader, load_weights
from dgpp.errors import UnsupportedModelError
from dgpp.family import LoadContext
from dgpp.quant.apply import convert_dense_weights, quantize_modules
from dgpp_flint.config import FlintArchConfig, parse_flint_config

FLINT = ("FlintForCausalLM", "flint")


def arch_config(ctx: LoadContext) -> FlintArchConfig:
    if ctx.architecture not in FLINT:
        raise UnsupportedModelError(f"{ctx.architecture!r} (family Flint) is claimed by dgpp-flint but not yet supported")
    return parse_flint_config(ctx.hf_config)


def load_model(ctx: LoadContext):
    from dgpp_flint.model import FlintForCausalLM

    cfg = arch_config(ctx)
    with torch.device(ctx.device or "cpu"):
        model = FlintForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group)
        quantize_modules(model, ctx.hf_config)
    reader = CheckpointReader(ctx.checkpoint_dir)
    try:
        load_weights(model, reader)
    finally:
        reader.close()
    convert_dense_weights(model, ctx.engine)
    return model.eval()
