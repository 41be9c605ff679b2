"""Tensor names -> modules for the GLM family: build the model for a ``LoadContext``, give the modules the
checkpoint stores quantized their packed form (ModelOpt NVFP4 for GLM-4.7), then fill every parameter
(``dgpp.engine.weights.load_family_weights``).
"""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, Model, UnsupportedModelError, load_family_weights
from dgpp_glm.config import Glm4MoeArchConfig, parse_glm4_moe_config

GLM4_MOE = ("Glm4MoeForCausalLM", "glm4_moe")


def checkpoint_name(name: str) -> str:
    """dgpp's shared MoE calls its shared expert ``shared_expert``; GLM checkpoints say ``shared_experts``."""
    return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


def arch_config(ctx: LoadContext) -> Glm4MoeArchConfig:
    if ctx.architecture not in GLM4_MOE:
        raise UnsupportedModelError(f"{ctx.architecture!r} (family GLM) is claimed by dgpp-glm but not yet supported")
    return parse_glm4_moe_config(ctx.hf_config)


def load_model(ctx: LoadContext) -> Model:
    from dgpp_glm.model import Glm4MoeForCausalLM

    cfg = arch_config(ctx)
    return load_family_weights(
        ctx, lambda: Glm4MoeForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group), checkpoint_name
    )
