"""The Flint memory plan: the exact per-rank bytes of the model as it would be built, without reading a weight.

The model is built on the ``meta`` device for this rank with the checkpoint's per-projection expert formats
swapped in (FP8 block-128 / NVFP4, as ``quantization_config`` resolves each projection), so the plan counts
what is really resident, with ``engine.bf16_weights``' bf12 repacking of the BF16 projections. KV per token
counts the full-attention layers only; each sliding layer holds a ring of ``sliding_window - 1`` positions per
request instead (state, counted per request), e.g. the release's 14 full layers x 4 kv heads x 128 x (K+V) x 2 B
= 28,672 B per token, and 35 sliding layers x 512 x 2 KiB = 35 MiB per request.
"""

from __future__ import annotations

import torch

from dgpp.plugin_api import LoadContext, ModelMemory, quantize_modules
from dgpp.quant.resident import resident_bytes
from dgpp_flint.loader import arch_config


def memory_plan(ctx: LoadContext) -> ModelMemory:
    from dgpp_flint.model import FlintForCausalLM

    cfg = arch_config(ctx)
    with torch.device("meta"):
        model = FlintForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world)
        quantize_modules(model, ctx.hf_config)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    world = ctx.world.size
    widest_mlp = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.num_experts_per_tok
                     + cfg.shared_expert_intermediate_size)
    full = sum(1 for t in cfg.layer_types if t == "full_attention")
    return ModelMemory.from_cache_spec(
        model.cache_spec(),
        weights=resident_bytes(model, ctx.engine.bf16_weights),
        # a prefill row: residual, normed input, q/k/v/attention rows, the widest MLP's gate/up/act on this rank
        activations_per_token=(8 * cfg.hidden_size + 3 * widest_mlp // world) * itemsize,
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        notes=(f"Flint plan: modules built on meta for rank {ctx.world.rank} of {world}; paged KV for {full} "
               f"full-attention layers, a {cfg.sliding_window - 1}-position ring per request for "
               f"{cfg.num_hidden_layers - full} sliding layers",),
    )
