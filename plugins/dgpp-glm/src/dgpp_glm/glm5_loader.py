"""Loading full GLM-5.3 (``glm_moe_dsa``): build the model for a ``LoadContext`` and fill it by tensor name;
every other GLM architecture goes on to ``dgpp_glm.loader``."""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, Model, load_family_weights
from dgpp_glm import loader
from dgpp_glm.glm5_config import parse_glm_moe_dsa_config

GLM_MOE_DSA = ("GlmMoeDsaForCausalLM", "glm_moe_dsa")


def load_model(ctx: LoadContext) -> Model:
    if ctx.architecture not in GLM_MOE_DSA:
        return loader.load_model(ctx)
    from dgpp_glm.glm5 import GlmMoeDsaForCausalLM

    cfg = parse_glm_moe_dsa_config(ctx.hf_config)
    return load_family_weights(
        ctx,
        lambda: GlmMoeDsaForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group),
        loader.checkpoint_name,
    )
