"""Full GLM-5.3's model memory (``glm_moe_dsa``); every other GLM architecture goes on to ``dgpp_glm.memory``.

The model is built on the ``meta`` device for this rank with the checkpoint's packed formats swapped in, so
the plan counts what is resident. Its cache is latent: per token and layer the normed latent and the rotated
rope key (``kv_lora_rank + qk_rope_head_dim`` values, replicated on every rank: MLA's latent has no heads to
split), plus one indexer key on each ``full`` layer. At release size in BF16 that is
78 x 576 x 2 + 21 x 128 x 2 = 95,232 B per token per rank (with ``engine.mtp`` the MTP block's
weights and its own latent and index-key rows are added). Core sizes the deployment's plan from it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dgpp.plugin_api import (
    LoadContext,
    ModelMemory,
    quantize_modules,
    settle_weights,
    tensor_bytes,
    transformer_activation_bytes,
)
from dgpp_glm import memory
from dgpp_glm.glm5_config import parse_glm_moe_dsa_config
from dgpp_glm.glm5_loader import GLM_MOE_DSA
from dgpp_glm.loader import checkpoint_name


def memory_plan(ctx: LoadContext) -> ModelMemory:
    if ctx.architecture not in GLM_MOE_DSA:
        return memory.memory_plan(ctx)
    from dgpp_glm.draft import MTPLayout
    from dgpp_glm.glm5 import GlmMoeDsaForCausalLM
    from dgpp_glm.glm5_draft import GlmMoeDsaMTPDrafter

    cfg = parse_glm_moe_dsa_config(ctx.hf_config)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world)
        quantize_modules(model, ctx.hf_config, rename=checkpoint_name)
        settle_weights(model)  # the loaded forms: MLA's kv_b_proj decoded
        spec, drafter_bytes = dict(model.cache_spec()), 0
        # the MTP block: its weights and its own latent (and index-key) cache
        if cfg.num_mtp_layers and ctx.engine.mtp:
            layout = MTPLayout.of(tensor_bytes(Path(ctx.checkpoint_dir)), cfg)
            drafter = GlmMoeDsaMTPDrafter(cfg, model, layout)
            if layout.packed:
                quantize_modules(drafter, ctx.hf_config, rename=drafter.checkpoint_name)
                settle_weights(drafter)
            spec.update(drafter.cache_spec())
            drafter_bytes = memory.resident_bytes(drafter, ctx.engine.bf16_weights)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    widest_mlp = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    return ModelMemory.from_cache_spec(
        spec,
        weights=memory.resident_bytes(model, ctx.engine.bf16_weights),
        activations_per_token=transformer_activation_bytes(
            cfg.hidden_size, widest_mlp, ctx.world.size, itemsize
        ),
        drafter=drafter_bytes,
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        notes=(
            f"GLM-5.3 plan: modules built on meta for rank {ctx.world.rank} of {ctx.world.size}; latent cache",
        ),
    )
