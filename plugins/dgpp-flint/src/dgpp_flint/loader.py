"""Tensor names -> modules for the Flint family: build the model for a ``LoadContext``, give the experts the
checkpoint stores quantized their packed form (per projection, as ``quantization_config`` resolves each one),
then fill every parameter (``dgpp.engine.weights.load_family_weights``).
"""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, Model, UnsupportedModelError, load_family_weights
from dgpp_flint.config import FlintArchConfig, parse_flint_config

FLINT = ("FlintForCausalLM", "flint")


def arch_config(ctx: LoadContext) -> FlintArchConfig:
    if ctx.architecture not in FLINT:
        raise UnsupportedModelError(f"{ctx.architecture!r} (family Flint) is claimed by dgpp-flint but not yet supported")
    return parse_flint_config(ctx.hf_config)


def load_model(ctx: LoadContext) -> Model:
    from dgpp_flint.model import FlintForCausalLM

    cfg = arch_config(ctx)
    return load_family_weights(ctx, lambda: FlintForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group),
                               lambda name: name)
