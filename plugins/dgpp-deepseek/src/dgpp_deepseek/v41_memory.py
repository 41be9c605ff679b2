"""DeepSeek-V4.1-Flash's memory (a model hook, as its load): the per-rank bytes of the model as the loader
would build it, without reading a weight.

The model is built on the ``meta`` device for this rank with the release's packed formats swapped in (MXFP4
routed experts, FP8 E4M3 + E8M0 32 x 32 block scales elsewhere, BF16 where the release stores it dense), so
the weights item is what is resident. The Engram tables are not modules: their bytes (read from the
checkpoint's headers when it is at hand, else from ``engram_num_embeddings``) join the weights under
``engine.ngram_table: resident`` and are reported as mapped file bytes, outside the GPU plan, under ``mmap``.
The cache rates come from ``cache_spec()``: per token the kv sources' compressed entries and index keys, per
request every layer's window ring, the ratio-2 sources' open pair and the Engram token context. With
``engine.mtp`` the DSpark stages join the weights and their context rows (one packed FP8 latent per token and
stage, 528 bytes at the release's width) the cache.
"""

from __future__ import annotations

import torch

from dgpp.plugin_api import CacheSpec, LoadContext, ModelMemory, PagedKV, quantize_modules, stored_as
from dgpp.quant.resident import resident_bytes
from dgpp_deepseek.memory import activation_bytes
from dgpp_deepseek.release_layout import release_hf_config
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
from dgpp_deepseek.v41_loader import build_model, checkpoint_name


def engram_table_bytes(cfg: DeepseekV41ArchConfig) -> int:
    """The Engram tables as the release stores them: an E4M3 byte per value and an E8M0 byte per 32."""
    per_row = cfg.engram_head_dim + -(-cfg.engram_head_dim // 32)
    return sum(cfg.engram_num_embeddings) * per_row


def _bytes_per_token(spec: dict[str, CacheSpec]) -> int:
    return sum(s.bytes_per_token() for s in spec.values() if isinstance(s, PagedKV))


def memory_plan(ctx: LoadContext) -> ModelMemory:
    from dgpp_deepseek.v41_dspark import context_spec

    cfg = DeepseekV41ArchConfig.from_hf_config(ctx.hf_config)
    with torch.device("meta"):
        model = build_model(cfg, ctx)
        quantize_modules(model, release_hf_config(ctx.hf_config), rename=checkpoint_name)
    spec = model.cache_spec()
    per_token = f"compressed entries and index keys (packed FP4) {_bytes_per_token(spec)} B/token"
    stages = getattr(model, "mtp", None)
    if stages is not None:
        drafts = context_spec(cfg, len(stages))
        spec = {**spec, **drafts}
        per_token += f", DSpark context rows (packed FP8) {_bytes_per_token(drafts)} B/token"
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    tables = engram_table_bytes(cfg)
    resident = ctx.engine.ngram_table == "resident"
    weights = resident_bytes(model, ctx.engine.bf16_weights, ctx.engine.dense_weights)
    return ModelMemory.from_cache_spec(
        stored_as(spec, ctx.engine.kv_dtype),  # kv_dtype fp8 is refused by name
        weights=weights + (tables if resident else 0),
        activations_per_token=activation_bytes(cfg, ctx.world.size, itemsize),
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        notes=(
            f"DeepSeek-V4.1 plan: modules built on meta for rank {ctx.world.rank} of {ctx.world.size} in the "
            "release's formats (the DSpark stages with engine.mtp); window rings per request",
            per_token,
            f"Engram tables: {tables / 2**30:.2f} GiB "
            + (
                "resident (in the weights)"
                if resident
                else "memory-mapped from the checkpoint (not in the plan)"
            ),
        ),
    )
