"""GLM-5.3-Flash's MTP layer (``glm5_next``) as a drafter, on GLM's MTP drafter (``dgpp_glm.draft``).

The release ships it at ``model.language_model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``, ``eh_proj``
``[H, 2H]``, ``shared_head.norm``, ``input_layernorm``, ``self_attn.*`` (NoPE MLA with its own k-pooled indexer),
``post_attention_layernorm`` and ``mlp.*`` (the sigmoid-routed MoE, SwiGLU clamped at ``swiglu_limit``); no
hyper-connection tensors: it is a plain pre-norm block. transformers drops it when loading the main model. As the
original engine runs it (github.com/HawkBearPig/dgpp, ``src/models/glm``), row ``q`` computes
``x = eh_proj([enorm(embed(token q + 1)) | hnorm(h_q)])`` from the main model's streams' mean ``h_q`` *before* the
final norm (``Glm5NextForCausalLM`` keeps that as ``last_hidden``), then ``x += attn(input_layernorm(x))``,
``x += mlp(post_attention_layernorm(x))`` at position ``q`` over the block's own latent, pooled index-key and
open-pool caches, and predicts token ``q + 2`` with the main head over ``shared_head.norm(x)``. A deeper draft feeds
the block's own ``x`` as the next row's ``h``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.nn.norm import RMSNorm
from dgpp.nn.parallel import all_reduce
from dgpp.plugin_api import ForwardBatch, LoadContext, World
from dgpp_glm import draft
from dgpp_glm.glm5_next import Glm5NextAttention, Glm5NextForCausalLM
from dgpp_glm.glm5_next_config import Glm5NextArchConfig
from dgpp_glm.glm5_next_release import release_context
from dgpp_glm.model import build_glm_moe


class Glm5NextMTPLayer(nn.Module):
    """One MTP layer: a pre-norm MLA (+ indexer) and MoE block with the MTP-only modules, named as in the
    checkpoint."""

    def __init__(
        self,
        cfg: Glm5NextArchConfig,
        step: int,
        layout: draft.MTPLayout,
        *,
        dtype: torch.dtype,
        world: World,
        group: Any = None,
    ) -> None:
        super().__init__()
        self.world = world
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Glm5NextAttention(
            cfg,
            cfg.num_hidden_layers + step,
            dtype=dtype,
            world=world,
            name=draft.mtp_cache_name(step),
            indexer=layout.indexer,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp: nn.Module = build_glm_moe(cfg, dtype=dtype, world=world, swiglu_limit=cfg.swiglu_limit)
        draft.add_mtp_parts(
            self,
            cfg,
            dtype=dtype,
            world=world,
            group=group,
            own_embed=layout.own_embed,
            own_head=layout.own_head,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, group: Any = None) -> torch.Tensor:
        # a block with no indexer attends densely: no layer before it in the drafter has a selection to share
        attn, _ = self.self_attn.select_and_attend(self.input_layernorm(x), batch, None)
        h = x + all_reduce(attn, self.world, group)
        return h + all_reduce(self.mlp(self.post_attention_layernorm(h)), self.world, group)


class Glm5NextMTPDrafter(draft.GlmMTPDrafter):
    """GLM-5.3-Flash's MTP layers over their own latent, index-key and open-pool caches."""

    def __init__(self, cfg: Glm5NextArchConfig, main: Glm5NextForCausalLM, layout: draft.MTPLayout) -> None:
        layers = [
            Glm5NextMTPLayer(cfg, i, layout, dtype=main.dtype, world=main.world, group=main.group)
            for i in range(cfg.num_mtp_layers)
        ]
        super().__init__(cfg, main, layers, embed=main.stack.embed_tokens)


def build_draft(ctx: LoadContext, model: Glm5NextForCausalLM) -> draft.GlmMTPDrafter | None:
    """The MTP drafter for ``model``'s checkpoint, weights loaded in the formats its names resolve; None when the
    config declares no MTP layer."""
    cfg = Glm5NextArchConfig.from_hf_config(ctx.hf_config)
    if cfg.num_mtp_layers == 0:
        return None
    return draft.load_mtp(
        release_context(ctx, cfg), cfg, lambda layout: Glm5NextMTPDrafter(cfg, model, layout)
    )
