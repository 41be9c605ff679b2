"""GLM-4.x MoE (``Glm4MoeForCausalLM``): the forward pass over the engine's paged KV.

Pre-norm decoder blocks: GQA attention with q/k/v biases, per-head q/k RMSNorm and half-split RoPE on
the first ``rotary_dim`` dims of each head; then a SwiGLU MLP in the first ``first_k_dense_replace``
layers and a sigmoid-routed MoE (correction bias, group-limited top-k, routed scaling, shared experts)
after. Module names follow the checkpoint's tensor names, so loading is a name-to-parameter walk.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.gqa import GQAttention
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.moe import RoutingConfig, SparseMoE
from dgpp.nn.norm import RMSNorm
from dgpp.nn.parallel import all_reduce
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.plugin_api import CacheSpec, ForwardBatch, Model, ModelInfo, PagedKV, World
from dgpp_glm.config import Glm4MoeArchConfig


def attention_cache_name(layer_idx: int) -> str:
    return f"layers.{layer_idx}.self_attn"


def build_glm_moe(cfg: Glm4MoeArchConfig, *, dtype: torch.dtype, world: World) -> SparseMoE:
    """GLM's MoE on the shared layer: fp32 sigmoid router, expert choice on score + correction bias
    within the best ``topk_group`` of ``n_group`` groups, weights = renormalized unbiased scores times
    ``routed_scaling_factor``; plus ``n_shared_experts`` ungated shared experts fused into one MLP."""
    routing = RoutingConfig(
        num_experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        scoring="sigmoid",
        renormalize=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        correction_bias=True,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        router_fp32=True,
    )
    return SparseMoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        routing,
        dtype=dtype,
        shared_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        world=world,
    )


def build_attention(cfg: Glm4MoeArchConfig, cache_name: str, *, dtype: torch.dtype, world: World) -> GQAttention:
    """GLM's GQA: q/k/v biases, per-head q/k norm before RoPE, half-split RoPE on the first ``rotary_dim``
    dims of each head (64 of 128 in GLM-4.7)."""
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, style="half")
    return GQAttention(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rotary, cache_name,
        dtype=dtype, qkv_bias=cfg.attention_bias, qk_norm=cfg.use_qk_norm, norm_eps=cfg.rms_norm_eps, world=world,
    )


class Glm4MoeDecoderLayer(nn.Module):
    """One pre-norm block: ``h = x + attn(norm(x))``; ``out = h + mlp(norm(h))`` (dense or MoE by index)."""

    def __init__(self, cfg: Glm4MoeArchConfig, layer_idx: int, cache_name: str, *, dtype: torch.dtype, world: World) -> None:
        super().__init__()
        self.world = world
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = build_attention(cfg, cache_name, dtype=dtype, world=world)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = build_glm_moe(cfg, dtype=dtype, world=world)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, world=world)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, group=None) -> torch.Tensor:
        h = x + all_reduce(self.self_attn(self.input_layernorm(x), batch), self.world, group)
        return h + all_reduce(self.mlp(self.post_attention_layernorm(h)), self.world, group)


class Glm4MoeBackbone(nn.Module):
    """``model.*`` of the checkpoint: embedding, the decoder stack, the final norm."""

    def __init__(self, cfg: Glm4MoeArchConfig, *, dtype: torch.dtype, world: World) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            Glm4MoeDecoderLayer(cfg, i, attention_cache_name(i), dtype=dtype, world=world)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class Glm4MoeForCausalLM(Model):
    """The GLM-4.x MoE model behind the engine's model contract.

    With ``keep_hidden`` on, ``forward`` keeps the post-final-norm hidden of every row in ``last_hidden``: GLM's
    MTP layer drafts from it (the vLLM convention; the pre-norm stream halved acceptance in the original engine).
    """

    backbone: type[nn.Module] = Glm4MoeBackbone  # GLM-5.3 swaps in its own decoder stack

    def __init__(self, cfg: Glm4MoeArchConfig, *, dtype: torch.dtype | None = None, world: World | None = None, group=None):
        super().__init__()
        self.config = cfg
        self.dtype = dtype or cfg.dtype
        self.world = world or World()
        self.group = group
        self.model = self.backbone(cfg, dtype=self.dtype, world=self.world)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, tied_to=tied, world=self.world, group=self.group
        )
        self.info = ModelInfo(
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            eos_token_ids=cfg.eos_token_ids,
            bos_token_id=cfg.bos_token_id,
            dtype=self.dtype,
            hybrid=False,
            extra={"num_mtp_layers": cfg.num_mtp_layers},
        )

    def cache_spec(self) -> dict[str, CacheSpec]:
        kv = PagedKV(self.config.num_key_value_heads // self.world.size, self.config.head_dim, self.dtype)
        return {attention_cache_name(i): kv for i in range(self.config.num_hidden_layers)}

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """Post-final-norm hidden of every row of ``batch`` ``[T, hidden]``."""
        x = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            x = layer(x, batch, self.group)
        return self.model.norm(x)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.hidden_states(batch)
        self.keep_last_hidden(hidden)
        return hidden[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
