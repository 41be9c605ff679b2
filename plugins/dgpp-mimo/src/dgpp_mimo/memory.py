"""The MiMo memory plan: the exact per-rank bytes of the model as it would be built, without reading a weight.

The model is built on the ``meta`` device for this rank with the checkpoint's quantized formats swapped in,
so the plan counts what is really resident, with ``engine.bf16_weights``' repacking of the BF16 projections.
KV per token counts the full-attention layers only; each sliding layer holds a ring of
``sliding_window - 1`` positions per request instead (state, counted per request). At the MiMo-V2-Flash
release's geometry in BF16: 9 full layers x 4 kv heads x (192 + 128) x 2 B = 23,040 B per token, and 39 sliding
layers x 128 positions x 8 kv heads x (192 + 128) x 2 B = 24.4 MiB per request.
"""

from __future__ import annotations

import torch

from dgpp.plugin_api import LoadContext, ModelMemory, quantize_modules
from dgpp.quant.resident import resident_bytes
from dgpp_mimo.loader import arch_config


def memory_plan(ctx: LoadContext) -> ModelMemory:
    from dgpp_mimo.model import MimoV2FlashForCausalLM
    from dgpp_mimo.v26_loader import V26, is_v26

    scheme, v26 = None, None
    if is_v26(ctx):  # the V2.6 release: the flash model, formats from the release's own keys
        v26 = V26.of(ctx)
        ctx, scheme = v26.ctx, v26.scheme()
    cfg = arch_config(ctx)
    with torch.device("meta"):
        model = MimoV2FlashForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world)
        quantize_modules(model, ctx.hf_config, scheme=scheme)
    spec, drafter_bytes = dict(model.cache_spec()), 0
    if v26 is not None and v26.mtp_layers and ctx.engine.mtp:  # V2.6's MTP layers, with their own paged KV
        from dgpp_mimo.draft import drafter_memory

        layers = min(v26.mtp_layers, ctx.engine.mtp_depth)
        mtp_spec, drafter_bytes = drafter_memory(cfg, model, layers, scheme, ctx.engine.bf16_weights, ctx.hf_config)
        spec.update(mtp_spec)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    world = ctx.world.size
    widest_mlp = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    widest_attn = max(s.num_heads * (2 * s.head_dim + s.v_head_dim) for s in cfg.attention.values())
    full = sum(1 for t in cfg.layer_types if t == "full_attention")
    return ModelMemory.from_cache_spec(
        spec,
        weights=resident_bytes(model, ctx.engine.bf16_weights),
        drafter=drafter_bytes,
        # a prefill row: residual, normed input, the q/k/v/attention rows and the widest MLP's gate/up/act on
        # this rank
        activations_per_token=(4 * cfg.hidden_size + (widest_attn + 3 * widest_mlp) // world) * itemsize,
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        notes=(f"MiMo plan: modules built on meta for rank {ctx.world.rank} of {world}; paged KV for {full} "
               f"full-attention layers, a {cfg.sliding_window - 1}-position ring per request for "
               f"{cfg.num_hidden_layers - full} sliding layers",),
    )
