"""``LlamaForCausalLM`` on dgpp's shared layers: pre-norm decoder layers of grouped-query attention
(rotate-half RoPE, optional q/k/v/o biases) and a SwiGLU MLP (optional biases), a final RMSNorm and a
head that may be tied to the embedding. Parameter names follow the HF checkpoints, so loading is a
plain name-for-name fill.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.gqa import GQAttention
from dgpp.nn.linear import Linear
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.norm import RMSNorm
from dgpp.nn.parallel import all_reduce
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.plugin_api import CacheSpec, ForwardBatch, Model, ModelInfo, PagedKV, World
from dgpp_llama.config import LlamaConfig
from dgpp_llama.rope import build_rotary


def kv_cache_name(layer: int) -> str:
    return f"layers.{layer}.self_attn"


def build_mlp(cfg: LlamaConfig, world: World) -> SwiGLUMLP:
    mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=cfg.dtype, world=world)
    if cfg.mlp_bias:  # same projections, with biases (the shared block has none)
        h, i = cfg.hidden_size, cfg.intermediate_size
        mlp.gate_proj = Linear(h, i, bias=True, dtype=cfg.dtype, parallel="column", world=world)
        mlp.up_proj = Linear(h, i, bias=True, dtype=cfg.dtype, parallel="column", world=world)
        mlp.down_proj = Linear(i, h, bias=True, dtype=cfg.dtype, parallel="row", world=world)
    return mlp


class LlamaDecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``; under TP each branch's partial sums are reduced."""

    def __init__(
        self, cfg: LlamaConfig, layer: int, rotary: RotaryEmbedding, world: World, group: Any
    ) -> None:
        super().__init__()
        self.world, self.group = world, group
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype)
        self.self_attn = GQAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            rotary,
            kv_cache_name(layer),
            dtype=cfg.dtype,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            world=world,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype)
        self.mlp = build_mlp(cfg, world)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = hidden + all_reduce(
            self.self_attn(self.input_layernorm(hidden), batch), self.world, self.group
        )
        return hidden + all_reduce(self.mlp(self.post_attention_layernorm(hidden)), self.world, self.group)


class LlamaBody(nn.Module):
    """``embed_tokens`` -> layers -> ``norm`` (the checkpoint's ``model.`` prefix)."""

    def __init__(self, cfg: LlamaConfig, world: World, group: Any) -> None:
        super().__init__()
        rotary = build_rotary(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary, world, group) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype)


class LlamaForCausalLM(Model):
    """The Llama text model over the engine's paged K/V pool."""

    def __init__(self, cfg: LlamaConfig, world: World | None = None, group: Any = None) -> None:
        super().__init__()
        world = world or World()
        self.cfg = cfg
        self.model = LlamaBody(cfg, world, group)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, tied_to=tied, world=world, group=group
        )
        self.kv_heads_local = cfg.num_kv_heads // world.size
        self.info = ModelInfo(
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position,
            eos_token_ids=cfg.eos_token_ids,
            bos_token_id=cfg.bos_token_id,
            dtype=cfg.dtype,
        )

    def cache_spec(self) -> dict[str, CacheSpec]:
        spec = PagedKV(num_kv_heads=self.kv_heads_local, head_dim=self.cfg.head_dim, dtype=self.cfg.dtype)
        return {kv_cache_name(i): spec for i in range(self.cfg.num_layers)}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, batch)
        return self.model.norm(hidden[batch.logits_indices])  # only sampled rows need the final norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
