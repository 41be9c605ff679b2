"""The GLM models' memory: the exact per-rank bytes of the model as it would be built, with its MTP drafter when
``engine.mtp`` is on, without reading a weight; core sizes the deployment's plan from them
(``dgpp.step.memory.plan_memory``). GLM's own plan (a model hook) because the drafter's layout (its own
embedding and head, packed or not) is read from the checkpoint's tensor names.

The model (and the MTP drafter when ``engine.mtp`` is on) is built on the ``meta`` device for this rank,
with the checkpoint's packed formats swapped in, so the plan counts what is really resident: the
replicated embedding, head, routers and norms in full, the TP-split projections and experts as this
rank's slice, NVFP4 experts at their packed size. KV per token comes from ``cache_spec()`` (the MTP
layer's own KV included), e.g. 92 + 1 layers x 2 kv heads x 128 x (K+V) x 2 B = 95,232 B at w4. Full GLM-5.3's
cache is latent: per token and layer the normed latent and the rotated rope key (``kv_lora_rank +
qk_rope_head_dim`` values, replicated on every rank), plus one indexer key on each ``full`` layer: at release
size in BF16, 78 x 576 x 2 + 21 x 128 x 2 = 95,232 B per token per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dgpp.plugin_api import (
    LoadContext,
    Model,
    ModelMemory,
    quantize_modules,
    settle_weights,
    tensor_bytes,
    transformer_activation_bytes,
)
from dgpp.quant.resident import resident_bytes
from dgpp_glm.config import Glm4MoeArchConfig, GlmMoeFields
from dgpp_glm.model import checkpoint_name

if TYPE_CHECKING:
    from dgpp_glm.draft import MTPLayout
    from dgpp_glm.glm5_next_vision import Glm5NextVisionConfig


def memory_plan(ctx: LoadContext) -> ModelMemory:
    from dgpp_glm.draft import Glm4MoeMTPDrafter
    from dgpp_glm.model import Glm4MoeForCausalLM

    cfg = Glm4MoeArchConfig.from_hf_config(ctx.hf_config)
    rank = f"modules built on meta for rank {ctx.world.rank} of {ctx.world.size}"
    return meta_plan(
        ctx,
        cfg,
        lambda: Glm4MoeForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world),
        lambda model, layout: Glm4MoeMTPDrafter(
            cfg, model, own_embed=layout.own_embed, own_head=layout.own_head
        ),
        lambda mtp: f"GLM plan: {rank}; KV includes the MTP layer" if mtp else f"GLM plan: {rank}",
    )


def glm5_memory_plan(ctx: LoadContext) -> ModelMemory:
    """Full GLM-5.3 (``glm_moe_dsa``): its latent cache, and its MLA + DSA MTP layers with ``engine.mtp``."""
    from dgpp_glm.glm5 import GlmMoeDsaForCausalLM
    from dgpp_glm.glm5_config import GlmMoeDsaArchConfig
    from dgpp_glm.glm5_draft import GlmMoeDsaMTPDrafter

    cfg = GlmMoeDsaArchConfig.from_hf_config(ctx.hf_config)
    note = f"GLM-5.3 plan: modules built on meta for rank {ctx.world.rank} of {ctx.world.size}; latent cache"
    return meta_plan(
        ctx,
        cfg,
        lambda: GlmMoeDsaForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world),
        lambda model, layout: GlmMoeDsaMTPDrafter(cfg, model, layout),
        lambda mtp: note,
    )


def glm5_next_memory_plan(ctx: LoadContext) -> ModelMemory:
    """GLM-5.3-Flash (``glm5_next``) as released: NVFP4 experts at their packed size and FP8 blocks with their scales
    (the formats the release's config and BF16 list resolve, ``dgpp_glm.glm5_next_release``), per token each indexed
    layer's latent row and 1 / ``index_kpool`` pooled index key, per request the KDA recurrent and conv state and
    the open pools' rings; with ``engine.mtp`` the MTP layer's weights and caches. The vision tower's weights are
    the model's; where a ``preprocessor_config.json`` makes it read images, the encoder's workspace is ``extra``."""
    from dgpp_glm.glm5_next import Glm5NextForCausalLM, checkpoint_name
    from dgpp_glm.glm5_next_config import Glm5NextArchConfig
    from dgpp_glm.glm5_next_draft import Glm5NextMTPDrafter
    from dgpp_glm.glm5_next_images import Glm5NextImageInput
    from dgpp_glm.glm5_next_release import plan_hf_config

    cfg = Glm5NextArchConfig.from_hf_config(ctx.hf_config)
    dtype = ctx.dtype or cfg.dtype
    rank = f"modules built on meta for rank {ctx.world.rank} of {ctx.world.size}"
    plan = meta_plan(
        ctx,
        cfg,
        lambda: Glm5NextForCausalLM(cfg, dtype=dtype, world=ctx.world),
        lambda model, layout: Glm5NextMTPDrafter(cfg, model, layout),
        lambda mtp: (
            f"GLM-5.3-Flash plan: {rank}; latent + pooled index cache, KDA state"
            + ("; KV includes the MTP layer" if mtp else "")
        ),
        rename=checkpoint_name,
        hf_config=plan_hf_config(ctx.hf_config, cfg),
    )
    if cfg.vision is None or not (Path(ctx.checkpoint_dir) / "preprocessor_config.json").exists():
        return plan  # no tower, or one that serves text only
    images = Glm5NextImageInput.from_checkpoint(ctx.hf_config, ctx.checkpoint_dir)
    itemsize = torch.empty((), dtype=dtype).element_size()
    workspace = vision_workspace_bytes(cfg.vision, images.max_patches, itemsize)
    return dataclasses.replace(plan, extra={**plan.extra, "vision_workspace": workspace})


def meta_plan(
    ctx: LoadContext,
    cfg: GlmMoeFields,
    build_model: Callable[[], Model],
    build_drafter: Callable[[Model, MTPLayout], nn.Module],
    note: Callable[[bool], str],
    *,
    rename: Callable[[str], str] = checkpoint_name,
    hf_config: dict[str, Any] | None = None,
) -> ModelMemory:
    """The plan of the model ``build_model()`` builds on ``meta`` for this rank, packed formats swapped in (as
    ``hf_config``, default the checkpoint's, resolves them under ``rename``d names), and, with ``engine.mtp`` on a
    config with MTP layers, of its drafter (weights and cache rows); ``note(mtp)``."""
    from dgpp_glm.draft import MTPLayout

    bf16 = ctx.engine.bf16_weights
    formats = ctx.hf_config if hf_config is None else hf_config
    with torch.device("meta"):
        model = build_model()
        quantize_modules(model, formats, rename=rename)
        settle_weights(model)  # the loaded forms (GLM-5.3: MLA's kv_b_proj decoded)
        spec, drafter_bytes = dict(model.cache_spec()), 0
        if cfg.num_mtp_layers and ctx.engine.mtp:
            layout = MTPLayout.of(tensor_bytes(Path(ctx.checkpoint_dir)), cfg)
            drafter = build_drafter(model, layout)
            if layout.packed:
                quantize_modules(drafter, formats, rename=drafter.checkpoint_name)
                settle_weights(drafter)
            spec.update(drafter.cache_spec())
            drafter_bytes = resident_bytes(drafter, bf16)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    widest_mlp = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    return ModelMemory.from_cache_spec(
        spec,
        weights=resident_bytes(model, bf16, ctx.engine.dense_weights),
        activations_per_token=transformer_activation_bytes(
            cfg.hidden_size, widest_mlp, ctx.world.size, itemsize
        ),
        drafter=drafter_bytes,
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        notes=(note(bool(drafter_bytes)),),
    )


def vision_workspace_bytes(vision: Glm5NextVisionConfig, max_patches: int, itemsize: int) -> int:
    """Scratch of one GLM-5.3-Flash encoder pass over the largest canvas the processor makes (``max_patches``):
    per patch row its fp32 pixels and rotary cos/sin, the residual and normed rows, q/k/v and the attention output
    (attention runs fused, without a score matrix), the MLP's gate, up and product; per merged row the folded
    patches, the merger's projection and its SwiGLU's gate, up and product."""
    per_patch = (
        4 * (vision.patch_values + 2 * vision.head_dim)
        + (6 * vision.hidden_size + 3 * vision.intermediate_size) * itemsize
    )
    merge = vision.spatial_merge_size**2
    per_row = (
        vision.hidden_size * merge + 2 * vision.out_hidden_size + 3 * vision.projection_intermediate_size
    ) * itemsize
    return max_patches * per_patch + max_patches // merge * per_row
