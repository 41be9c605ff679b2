"""The MiMo-V2.6 memory plan: the flash model built on ``meta`` for this rank with the formats the release's own
keys give (``V26Scheme``) and, with ``engine.mtp``, its MTP layers beside it. (A ``mimo_v2_flash`` checkpoint is
planned by core from the model alone.) KV per token counts the full-attention layers only; each sliding layer
holds a ring of ``sliding_window - 1`` positions per request instead (state, counted per request). At the
MiMo-V2-Flash geometry in BF16: 9 full layers x 4 kv heads x (192 + 128) x 2 B = 23,040 B per token, and 39
sliding layers x 128 positions x 8 kv heads x (192 + 128) x 2 B = 24.4 MiB per request.
"""

from __future__ import annotations

import torch

from dgpp.plugin_api import LoadContext, ModelMemory, quantize_modules, stored_as
from dgpp.quant.resident import resident_bytes


def memory_plan(ctx: LoadContext) -> ModelMemory:
    from dgpp_mimo.model import MimoV2FlashForCausalLM
    from dgpp_mimo.v26_loader import V26

    v26 = V26.of(ctx)
    ctx, scheme, cfg = v26.ctx, v26.scheme(), v26.cfg
    with torch.device("meta"):
        model = MimoV2FlashForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world)
        quantize_modules(model, ctx.hf_config, scheme=scheme)
    spec, drafter_bytes = dict(model.cache_spec()), 0
    if v26.mtp_layers and ctx.engine.mtp:  # V2.6's MTP layers, with their own paged KV
        from dgpp_mimo.draft import drafter_memory

        layers = min(v26.mtp_layers, ctx.engine.mtp_depth)
        mtp_spec, drafter_bytes = drafter_memory(
            cfg, model, layers, scheme, ctx.engine.bf16_weights, ctx.hf_config
        )
        spec.update(mtp_spec)
    full = sum(1 for t in cfg.layer_types if t == "full_attention")
    return ModelMemory.from_cache_spec(
        stored_as(spec, ctx.engine.kv_dtype),
        weights=resident_bytes(model, ctx.engine.bf16_weights, ctx.engine.dense_weights),
        drafter=drafter_bytes,
        activations_per_token=model.activation_bytes_per_token(),
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        notes=(
            f"MiMo plan: modules built on meta for rank {ctx.world.rank} of {ctx.world.size}; paged KV for {full} "
            f"full-attention layers, a {cfg.sliding_window - 1}-position ring per request for "
            f"{cfg.num_hidden_layers - full} sliding layers",
        ),
    )
