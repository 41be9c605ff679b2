"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): the forward pass over the engine's caches.

The residual is ``hc_mult`` parallel streams (manifold-constrained hyper-connections, ``dgpp.nn.hyper_connections``):
each layer collapses them into its attention's input and expands the output back (``attn_hc``), then the same for
its MoE (``ffn_hc``); after the last layer ``hc_head`` collapses them once more before the final norm. Attention
(``dgpp_deepseek.attention``): a 128-token window on every layer, plus compressed entries on CSA / HCA layers.
MoE: sqrt-softplus scores, the correction bias on learned layers, experts by token id (``tid2eid``) on the hash
layers, renormalized top-k times ``routed_scaling_factor``, SwiGLU clamped at ``swiglu_limit`` in the routed and
the shared experts. Module names follow the release's tensor names (``dgpp_deepseek.names`` maps the rest).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.nn.decoder import causal_lm_info
from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.hyper_connections import HyperConnection, HyperHead, to_streams
from dgpp.nn.moe import RoutingConfig, SparseMoE
from dgpp.nn.parallel import all_reduce
from dgpp.nn.window_compressor import FP32WeightRMSNorm
from dgpp.plugin_api import ForwardBatch, Model, World
from dgpp_deepseek.attention import DeepseekV4Attention
from dgpp_deepseek.config import DeepseekV4ArchConfig, LatentMoEFields


def build_moe(cfg: DeepseekV4ArchConfig, layer_idx: int, *, dtype: torch.dtype, world: World) -> SparseMoE:
    hashed = cfg.mlp_layer_types[layer_idx] == "hash_moe"
    routing = RoutingConfig(
        num_experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        scoring=cfg.scoring_func,
        renormalize=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        correction_bias=not hashed,
        hash_vocab_size=cfg.vocab_size if hashed else 0,
    )
    return sparse_moe(cfg, routing, dtype=dtype, world=world)


def sparse_moe(
    cfg: LatentMoEFields,
    routing: RoutingConfig,
    *,
    dtype: torch.dtype,
    world: World,
) -> SparseMoE:
    """A layer's routed experts (this rank's intermediate slice) and shared experts under ``routing``, SwiGLU
    clamped at ``swiglu_limit`` in both (V4's and V4.1's alike)."""
    return SparseMoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        routing,
        dtype=dtype,
        shared_intermediate_size=cfg.n_shared_experts * cfg.moe_intermediate_size,
        world=world,
        swiglu_limit=cfg.swiglu_limit,
    )


class DeepseekV4Block(nn.Module):
    """``layers.N``: attention and MoE, each between a collapse and an expand of the residual streams."""

    def __init__(
        self, cfg: DeepseekV4ArchConfig, layer_idx: int, *, dtype: torch.dtype, world: World
    ) -> None:
        super().__init__()
        self.world = world
        eps = cfg.rms_norm_eps
        self.attn_hc = HyperConnection.from_config(cfg)
        self.ffn_hc = HyperConnection.from_config(cfg)
        self.attn_norm = FP32WeightRMSNorm(cfg.hidden_size, eps)
        self.attn = DeepseekV4Attention(cfg, layer_idx, dtype=dtype)
        self.ffn_norm = FP32WeightRMSNorm(cfg.hidden_size, eps)
        self.ffn = build_moe(cfg, layer_idx, dtype=dtype, world=world)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, group: Any = None) -> torch.Tensor:
        x, post, comb = self.attn_hc.collapse(streams)
        streams = self.attn_hc.expand(streams, self.attn(self.attn_norm(x), batch), post, comb)
        x, post, comb = self.ffn_hc.collapse(streams)
        out = all_reduce(self.ffn(self.ffn_norm(x), batch.input_ids), self.world, group)
        return self.ffn_hc.expand(streams, out, post, comb)


class DeepseekV4ForCausalLM(Model):
    """DeepSeek-V4 behind the engine's model contract. Every layer holds per-request state (its window ring and,
    on compressed layers, the rows of the open window), so ``info.hybrid`` is set: the prefix cache attaches
    where it holds a state snapshot. The release's draft stages hang off it as ``mtp`` (``draft_blocks``).

    ``last_hidden`` (while ``keep_hidden`` is on) is the DSpark drafter's features when ``feature_layers`` names
    layers (``dgpp_deepseek.dspark``): per row, the mean over the streams entering each of those layers,
    concatenated in that order; else the final normed hidden."""

    #: the layers whose input streams' mean is kept (set by the DSpark drafter)
    feature_layers: tuple[int, ...] = ()

    def __init__(
        self,
        cfg: DeepseekV4ArchConfig,
        *,
        dtype: torch.dtype | None = None,
        world: World | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype or cfg.dtype
        self.world = world or World()
        self.group = group
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype)
        self.layers = nn.ModuleList(
            DeepseekV4Block(cfg, i, dtype=self.dtype, world=self.world) for i in range(cfg.num_hidden_layers)
        )
        self.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        self.norm = FP32WeightRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        tied = self.embed if cfg.tie_word_embeddings else None
        self.head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=self.dtype,
            tied_to=tied,
            world=self.world,
            group=self.group,
        )
        self.info = causal_lm_info(cfg, self.dtype, hybrid=True)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        streams = to_streams(self.embed(batch.input_ids), self.config.hc_mult)
        features = self.feature_layers if self.keep_hidden else ()
        means: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in features:
                means[i] = streams.mean(dim=1)
            streams = layer(streams, batch, self.group)
        hidden = self.norm(self.hc_head(streams))
        self.keep_last_hidden(torch.cat([means[i] for i in features], dim=-1) if features else hidden)
        return hidden[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
