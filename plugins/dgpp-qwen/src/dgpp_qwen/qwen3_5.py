"""Qwen3.5 hybrids: ``qwen3_5`` (Qwen3.8-27B, dense SwiGLU) and ``qwen3_5_moe`` (Qwen3.5-122B-A10B, routed experts
plus a sigmoid-gated shared expert).

Layers follow the config's ``layer_types``: ``linear_attention`` layers are Gated DeltaNet token mixers
(per-request conv + recurrent state), ``full_attention`` layers are GQA over the paged K/V pool with a
``[q|gate]`` q_proj, per-head zero-centred q/k RMSNorm, rotate-half RoPE on the first
``partial_rotary_factor`` of each head (mRoPE collapses to 1-D for text) and a sigmoid output gate.
Every norm outside the GDN output norm is zero-centred ``(1+w)``.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.engine.batch import ForwardBatch
from dgpp.engine.cache_spec import CacheSpec, PagedKV
from dgpp.engine.model import Model, ModelInfo
from dgpp.errors import ConfigError
from dgpp.nn.attention import PagedAttention, gated_output, split_query_gate
from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.gated_deltanet import GatedDeltaNet
from dgpp.nn.linear import Linear
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.moe import RoutingConfig, SparseMoE
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RotaryEmbedding
from dgpp_qwen.config import QwenConfig

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


def layer_cache_name(index: int) -> str:
    return f"layers.{index}"


class GatedFullAttention(nn.Module):
    """Qwen3.5 full-attention layer: q/k/v projections, q/k norm, partial RoPE, paged attention, σ(gate)·o."""

    def __init__(self, cfg: QwenConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        dtype, hidden, head_dim = cfg.dtype, cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * head_dim * 2, bias=bias, dtype=dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = Linear(self.num_heads * head_dim, hidden, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)
        self.rotary = rotary
        self.attn = PagedAttention(layer_cache_name(index), self.num_heads, self.num_kv_heads, head_dim)

    def cache_spec(self, dtype: torch.dtype) -> PagedKV:
        return PagedKV(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = hidden.shape[0]
        q, gate = split_query_gate(self.q_proj(hidden), self.num_heads, self.head_dim)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(rows, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(rows, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        return self.o_proj(gated_output(self.attn(q, k, v, batch), gate))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated full attention), then the MLP or MoE."""

    def __init__(self, cfg: QwenConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        dtype, hidden = cfg.dtype, cfg.hidden_size
        self.layer_type = cfg.layer_types[index]
        if self.layer_type == LINEAR_ATTENTION:
            gdn = cfg.linear_attn
            if gdn is None:
                raise ConfigError(f"config.json: layer_types[{index}] = 'linear_attention' needs a qwen3_5 model_type")
            self.linear_attn = GatedDeltaNet(
                layer_cache_name(index),
                hidden_size=hidden,
                num_k_heads=gdn.num_key_heads,
                num_v_heads=gdn.num_value_heads,
                head_k_dim=gdn.key_head_dim,
                head_v_dim=gdn.value_head_dim,
                conv_kernel=gdn.conv_kernel,
                eps=cfg.rms_norm_eps,
                dtype=dtype,
            )
        else:
            self.self_attn = GatedFullAttention(cfg, index, rotary)
        moe = cfg.moe
        if moe is not None and cfg.is_moe_layer(index):
            routing = RoutingConfig(
                num_experts=moe.num_experts, top_k=moe.top_k, scoring="softmax", renormalize=moe.norm_topk_prob
            )
            self.mlp: nn.Module = SparseMoE(
                hidden, moe.intermediate_size, routing, dtype=dtype,
                shared_intermediate_size=moe.shared_expert_intermediate_size,
                shared_gate=moe.shared_expert_intermediate_size > 0,
            )
        else:
            self.mlp = SwiGLUMLP(hidden, cfg.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)

    def cache_spec(self, dtype: torch.dtype) -> CacheSpec:
        if self.layer_type == LINEAR_ATTENTION:
            return self.linear_attn.cache_spec()
        return self.self_attn.cache_spec(dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.layer_type == LINEAR_ATTENTION:
            mixed = self.linear_attn(normed, batch)
        else:
            mixed = self.self_attn(normed, batch)
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen35TextStack(nn.Module):
    """``embed_tokens`` -> decoder layers -> final norm (the checkpoint's ``model.`` or
    ``model.language_model.`` prefix)."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        rope = cfg.rope
        rotary = RotaryEmbedding(
            cfg.head_dim, rope.rotary_dim, rope.theta, style="half", yarn=rope.yarn, mrope_section=rope.mrope_section
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, dtype=cfg.dtype)


class Qwen35ForCausalLM(Model):
    """The text model of Qwen3.5 / Qwen3.8-27B / Qwen3.5-122B-A10B (vision tower and MTP weights are not loaded)."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen35TextStack(cfg)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, tied_to=tied)
        self.info = ModelInfo(
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position,
            eos_token_ids=tuple(cfg.eos_token_ids),
            bos_token_id=cfg.bos_token_id,
            dtype=cfg.dtype,
            hybrid=any(t == LINEAR_ATTENTION for t in cfg.layer_types),
        )

    def cache_spec(self) -> dict[str, CacheSpec]:
        return {layer_cache_name(i): layer.cache_spec(self.cfg.dtype) for i, layer in enumerate(self.model.layers)}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, batch)
        # the final norm only on the rows that are sampled from
        return self.model.norm(hidden[batch.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

