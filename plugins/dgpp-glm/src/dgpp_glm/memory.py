"""The GLM model's memory (``dgpp_memory_plan``): the exact per-rank bytes of the model as it would be built,
without reading a weight; core sizes the deployment's plan from them (``dgpp.engine.memory.plan_memory``).

The model (and the MTP drafter when ``engine.mtp`` is on) is built on the ``meta`` device for this rank,
with the checkpoint's packed formats swapped in, so the plan counts what is really resident: the
replicated embedding, head, routers and norms in full, the TP-split projections and experts as this
rank's slice, NVFP4 experts at their packed size. KV per token comes from ``cache_spec()`` (the MTP
layer's own KV included), e.g. 92 + 1 layers x 2 kv heads x 128 x (K+V) x 2 B = 95,232 B at w4.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dgpp.nn.linear import Linear, UnquantizedLinearMethod
from dgpp.plugin_api import (
    LoadContext,
    ModelMemory,
    quantize_modules,
    tensor_bytes,
    transformer_activation_bytes,
)
from dgpp_glm.loader import arch_config, checkpoint_name

# engine.bf16_weights: resident bytes of an eligible BF16 matrix, relative to BF16 (bf12 packs to ~0.75)
_BF12_FACTOR = {"checkpoint": 1.0, "bf12": 0.75, "bf12+bf16": 1.75}


def resident_bytes(module: nn.Module, bf16_weights: str = "checkpoint") -> int:
    """Bytes of ``module``'s (unique) parameters, with the bf12 repacking ``engine.bf16_weights`` applies."""
    total = 0.0
    bf12_eligible = {
        id(m.weight) for m in module.modules()
        if isinstance(m, Linear) and isinstance(m.quant_method, UnquantizedLinearMethod)
        and m.weight.dtype == torch.bfloat16 and m.weight.shape[1] % 1024 == 0
    }
    for p in module.parameters():
        size = p.numel() * p.element_size()
        total += size * (_BF12_FACTOR[bf16_weights] if id(p) in bf12_eligible else 1.0)
    return int(total)


def memory_plan(ctx: LoadContext) -> ModelMemory:
    from dgpp_glm.draft import Glm4MoeMTPDrafter, MTPLayout
    from dgpp_glm.model import Glm4MoeForCausalLM

    cfg = arch_config(ctx)
    engine = ctx.engine
    bf16 = engine.bf16_weights
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world)
        quantize_modules(model, ctx.hf_config, rename=checkpoint_name)
        spec = dict(model.cache_spec())
        drafter_bytes = 0
        if cfg.num_mtp_layers and engine.mtp:
            layout = MTPLayout.of(tensor_bytes(Path(ctx.checkpoint_dir)), cfg)
            drafter = Glm4MoeMTPDrafter(cfg, model, own_embed=layout.own_embed, own_head=layout.own_head)
            if layout.packed:
                quantize_modules(drafter, ctx.hf_config, rename=drafter.checkpoint_name)
            spec.update(drafter.cache_spec())
            drafter_bytes = resident_bytes(drafter, bf16)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    world = ctx.world.size
    widest_mlp = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    return ModelMemory.from_cache_spec(
        spec,
        weights=resident_bytes(model, bf16),
        activations_per_token=transformer_activation_bytes(cfg.hidden_size, widest_mlp, world, itemsize),
        drafter=drafter_bytes,
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        notes=(f"GLM plan: modules built on meta for rank {ctx.world.rank} of {world}; KV includes the MTP layer"
               if drafter_bytes else f"GLM plan: modules built on meta for rank {ctx.world.rank} of {world}",),
    )
