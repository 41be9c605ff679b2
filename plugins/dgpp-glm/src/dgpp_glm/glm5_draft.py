"""Full GLM-5.3's MTP layer (``glm_moe_dsa``) as a drafter, on GLM-4.7's (``dgpp_glm.draft``).

Checkpoint layout (transformers skips it when loading the main model): MTP layer ``i`` is
``model.layers.{num_hidden_layers + i}.*``, a GLM-5.3 decoder block (MLA ``self_attn`` with, when the
checkpoint ships ``self_attn.indexer.*``, its own DSA indexer; a MoE ``mlp``; both layer norms) plus GLM's
MTP-only tensors (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, optionally ``embed_tokens`` and
``shared_head.head``). The block runs over its own latent cache (and indexer-key cache) in the drafter's
pools; a block without an indexer attends densely (there is no earlier layer in the drafter whose selection
it could reuse). Rows are fed the main model's post-final-norm hidden, as GLM-4.7's.
"""

from __future__ import annotations

from typing import Any

import torch

from dgpp.plugin_api import ForwardBatch, LoadContext
from dgpp_glm import draft
from dgpp_glm.glm5 import GlmMoeDsaDecoderLayer, GlmMoeDsaForCausalLM
from dgpp_glm.glm5_config import GlmMoeDsaArchConfig


class GlmMoeDsaMTPLayer(GlmMoeDsaDecoderLayer):
    """One GLM-5.3 MTP layer: an MoE decoder block with the MTP-only modules."""

    def __init__(
        self,
        cfg: GlmMoeDsaArchConfig,
        step: int,
        layout: draft.MTPLayout,
        *,
        dtype: torch.dtype,
        world,
        group: Any = None,
    ) -> None:
        super().__init__(
            cfg,
            cfg.num_hidden_layers + step,
            dtype=dtype,
            world=world,
            name=draft.mtp_cache_name(step),
            indexer=layout.indexer,
            moe=True,
        )
        draft.add_mtp_parts(
            self,
            cfg,
            dtype=dtype,
            world=world,
            group=group,
            own_embed=layout.own_embed,
            own_head=layout.own_head,
        )


class GlmMoeDsaMTPDrafter(draft.GlmMTPDrafter):
    """GLM-5.3's MTP layers: MLA (+ DSA) + MoE blocks, each with its latent cache (and indexer keys)."""

    def __init__(self, cfg: GlmMoeDsaArchConfig, main: GlmMoeDsaForCausalLM, layout: draft.MTPLayout) -> None:
        layers = [
            GlmMoeDsaMTPLayer(cfg, i, layout, dtype=main.dtype, world=main.world, group=main.group)
            for i in range(cfg.num_mtp_layers)
        ]
        super().__init__(cfg, main, layers)

    def run_block(self, layer: GlmMoeDsaMTPLayer, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return layer(x, batch, None, self.group)[0]


def build_draft(ctx: LoadContext, model) -> draft.GlmMTPDrafter | None:
    """The MTP drafter for ``model``'s checkpoint, weights loaded; None when it has no MTP layer."""
    cfg = GlmMoeDsaArchConfig.from_hf_config(ctx.hf_config)
    return draft.load_mtp(ctx, cfg, lambda layout: GlmMoeDsaMTPDrafter(cfg, model, layout))
