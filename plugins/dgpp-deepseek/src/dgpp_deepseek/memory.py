"""DeepSeek-V4's memory (a model hook, as its load): the per-rank bytes of the model as the loader would build
it, without reading a weight; core sizes the deployment's plan from them (``dgpp.startup.memory_plan``).

The model is built on the ``meta`` device for this rank with the release's packed formats swapped in
(``dgpp_deepseek.release_layout``: MXFP4 routed experts, FP8 E4M3 + E8M0 block scales for the attention
projections, the indexer's query projection and the shared expert; BF16 router, compressors, indexer weights,
embedding and head), so the weights item is what is resident: the experts as this rank's intermediate slice,
the rest replicated (one shared latent K/V head has nothing to split), the head vocab-sharded. The cache rates
come from ``cache_spec()``: per token a compressed entry per ratio (CSA: a 512-wide main entry per 4 tokens and
a 128-wide indexer key per 4; HCA: one 512-wide entry per 128), per request the 128-token window ring of every
layer and the compressors' open-window rows. The checkpoint's ``mtp.*`` draft stages are resident
(``dgpp_deepseek.draft_blocks``) and counted with the weights, from its headers; with ``engine.mtp`` the DSpark
drafter's context adds one latent row per token for each stage (``dgpp_deepseek.dspark``).
"""

from __future__ import annotations

import torch

from dgpp.plugin_api import (
    LoadContext,
    ModelMemory,
    quantize_modules,
    stored_as,
    transformer_activation_bytes,
)
from dgpp.quant.resident import resident_bytes
from dgpp_deepseek.config import DeepseekV4ArchConfig, LatentMoEFields
from dgpp_deepseek.loader import checkpoint_name
from dgpp_deepseek.release_layout import release_hf_config


def activation_bytes(cfg: LatentMoEFields, world: int, itemsize: int) -> int:
    """Scratch of one prefill row, V4's and V4.1's alike: a transformer block's (``transformer_activation_bytes``)
    plus the hyper-connection streams in and out (``2 x hc_mult x hidden``), the 64 query heads of 512 and the
    grouped output's ``o_groups x o_lora_rank``, the indexer's query heads, and fp32 attention scores over the
    window and the selected entries for every head."""
    widest_mlp = cfg.moe_intermediate_size * cfg.num_experts_per_tok
    base = transformer_activation_bytes(cfg.hidden_size, widest_mlp, world, itemsize)
    wide = (
        2 * cfg.hc_mult * cfg.hidden_size
        + cfg.num_attention_heads * cfg.head_dim
        + cfg.o_groups * cfg.o_lora_rank
        + cfg.index_n_heads * cfg.index_head_dim
    )
    scores = cfg.num_attention_heads * (cfg.sliding_window + cfg.index_topk) * 4
    return base + wide * itemsize + scores


def memory_plan(ctx: LoadContext) -> ModelMemory:
    from dgpp_deepseek.draft_blocks import attach_draft_blocks
    from dgpp_deepseek.dspark import DSparkConfig, dspark_cache_spec
    from dgpp_deepseek.model import DeepseekV4ForCausalLM

    cfg = DeepseekV4ArchConfig.from_hf_config(ctx.hf_config)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world)
        attach_draft_blocks(model, cfg, ctx.checkpoint_dir, world=ctx.world)  # counted: they are resident
        quantize_modules(model, release_hf_config(ctx.hf_config), rename=checkpoint_name)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    spec = model.cache_spec()
    stages = getattr(model, "mtp", None)
    if ctx.engine.mtp and stages is not None and DSparkConfig.from_hf_config(ctx.hf_config, cfg) is not None:
        spec = {**spec, **dspark_cache_spec(cfg, len(stages), model.dtype)}
    return ModelMemory.from_cache_spec(
        stored_as(spec, ctx.engine.kv_dtype),  # kv_dtype fp8 is refused by name (compressed entries)
        weights=resident_bytes(model, ctx.engine.bf16_weights, ctx.engine.dense_weights),
        activations_per_token=activation_bytes(cfg, ctx.world.size, itemsize),
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        notes=(
            f"DeepSeek-V4 plan: modules built on meta for rank {ctx.world.rank} of {ctx.world.size} in the release's "
            "formats (mtp.* draft stages included); compressed entries per token, window rings per request",
        ),
    )
