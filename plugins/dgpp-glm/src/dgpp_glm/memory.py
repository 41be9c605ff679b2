"""The GLM memory plan: the exact per-rank bytes of the model as it would be built, without reading a weight.

The model (and the MTP drafter when ``engine.mtp`` is on) is built on the ``meta`` device for this rank,
with the checkpoint's packed formats swapped in, so the plan counts what is really resident: the
replicated embedding, head, routers and norms in full, the TP-split projections and experts as this
rank's slice, NVFP4 experts at their packed size. KV per token comes from ``cache_spec()`` (the MTP
layer's own KV included), e.g. 92 + 1 layers x 2 kv heads x 128 x (K+V) x 2 B = 95,232 B at w4.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dgpp.engine.memory import MemoryPlan
from dgpp.engine.memory_estimate import tensor_bytes
from dgpp.family import LoadContext
from dgpp.quant.apply import quantize_modules
from dgpp.quant.resident import resident_bytes
from dgpp_glm.loader import arch_config, checkpoint_name


def memory_plan(ctx: LoadContext) -> MemoryPlan:
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
    max_conc = engine.max_concurrency
    depth = engine.mtp_depth if engine.mtp else 0
    budget = engine.prefill_budget_tokens
    widest_mlp = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    return MemoryPlan.from_cache_spec(
        spec,
        weights=resident_bytes(model, bf16),
        # a prefill row: residual, normed input, q/k/v/attention rows, the widest MLP's gate/up/act on this rank
        activations_per_token=(8 * cfg.hidden_size + 3 * widest_mlp // world) * itemsize,
        drafter=drafter_bytes,
        kv_capacity=engine.kv_capacity,
        max_concurrency=max_conc,
        prefill_tokens=max(256 if budget < 0 else budget, engine.prefill_idle_budget_tokens),
        extra={"logits": 4 * cfg.vocab_size * max(max_conc * (1 + depth), 8)},
        notes=(f"GLM plan: modules built on meta for rank {ctx.world.rank} of {world}; KV includes the MTP layer"
               if drafter_bytes else f"GLM plan: modules built on meta for rank {ctx.world.rank} of {world}",),
    )
