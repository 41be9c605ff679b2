"""Full GLM-5.3's model memory (``glm_moe_dsa``); every other GLM architecture goes on to ``dgpp_glm.memory``.

The model is built on the ``meta`` device for this rank with the checkpoint's packed formats swapped in, so
the plan counts what is resident. Its cache is latent: per token and layer the normed latent and the rotated
rope key (``kv_lora_rank + qk_rope_head_dim`` values, replicated on every rank: MLA's latent has no heads to
split), plus one indexer key on each ``full`` layer. At release size in BF16 that is
78 x 576 x 2 + 21 x 128 x 2 = 95,232 B per token per rank (with ``engine.mtp`` the MTP block's
weights and its own latent and index-key rows are added). Core sizes the deployment's plan from it.
"""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, ModelMemory
from dgpp_glm import memory
from dgpp_glm.glm5_config import parse_glm_moe_dsa_config
from dgpp_glm.glm5_loader import GLM_MOE_DSA


def memory_plan(ctx: LoadContext) -> ModelMemory:
    if ctx.architecture not in GLM_MOE_DSA:
        return memory.memory_plan(ctx)
    from dgpp_glm.glm5 import GlmMoeDsaForCausalLM
    from dgpp_glm.glm5_draft import GlmMoeDsaMTPDrafter

    cfg = parse_glm_moe_dsa_config(ctx.hf_config)
    note = f"GLM-5.3 plan: modules built on meta for rank {ctx.world.rank} of {ctx.world.size}; latent cache"
    return memory.meta_plan(
        ctx, cfg, lambda: GlmMoeDsaForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world),
        lambda model, layout: GlmMoeDsaMTPDrafter(cfg, model, layout), lambda mtp: note,
    )
