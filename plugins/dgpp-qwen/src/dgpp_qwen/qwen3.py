"""Qwen3 (dense) and Qwen3-MoE: pre-norm decoder layers of GQA attention (per-head q/k RMSNorm,
rotate-half RoPE) and a SwiGLU MLP or a softmax top-k MoE (``mlp_only_layers`` /
``decoder_sparse_step`` pick which layers are sparse). Parameter names follow the HF checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.moe import RoutingConfig, SparseMoE
from dgpp.nn.norm import RMSNorm, add_rms_norm
from dgpp.nn.parallel import all_reduce
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.plugin_api import ForwardBatch, Model, ModelInfo, World
from dgpp_qwen.config import QwenConfig
from dgpp_qwen.layers.attention import QwenAttention, build_rotary


def build_mlp(cfg: QwenConfig, layer: int, world: World) -> nn.Module:
    moe = cfg.moe
    if moe is None or not cfg.is_moe_layer(layer):
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=cfg.dtype, world=world)
    routing = RoutingConfig(
        num_experts=moe.num_experts, top_k=moe.top_k, scoring="softmax", renormalize=moe.norm_topk_prob
    )
    return SparseMoE(
        cfg.hidden_size,
        moe.intermediate_size,
        routing,
        dtype=cfg.dtype,
        shared_intermediate_size=moe.shared_expert_intermediate_size,
        shared_gate=moe.shared_expert_intermediate_size > 0,
        world=world,
    )


class Qwen3DecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``; under TP both branches end row-parallel, so
    their partial sums are reduced before the residual add.

    ``forward`` takes this layer's normed input and the residual stream, and returns the MLP's reduced output
    with the stream before that output is added: the add is fused into the next norm (``add_rms_norm``).
    """

    def __init__(
        self, cfg: QwenConfig, layer: int, rotary: RotaryEmbedding, world: World, group: Any = None
    ) -> None:
        super().__init__()
        self.world, self.group = world, group
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype)
        self.self_attn = QwenAttention(cfg, f"layers.{layer}.self_attn", rotary, world=world)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype)
        self.mlp = build_mlp(cfg, layer, world)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = all_reduce(self.self_attn(x, batch), self.world, self.group)
        x, residual = add_rms_norm(attn, residual, self.post_attention_layernorm)
        return all_reduce(self.mlp(x), self.world, self.group), residual


class Qwen3Body(nn.Module):
    """``embed_tokens`` -> layers -> ``norm`` (the checkpoint's ``model.`` prefix)."""

    def __init__(self, cfg: QwenConfig, world: World, group: Any = None) -> None:
        super().__init__()
        rotary = build_rotary(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, i, rotary, world, group) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype)


class Qwen3ForCausalLM(Model):
    """Qwen3 / Qwen3-MoE text model over the engine's paged K/V pool."""

    def __init__(
        self,
        cfg: QwenConfig,
        world: World | None = None,
        group: Any = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        cfg = dataclasses.replace(cfg, dtype=dtype or cfg.dtype)  # ``dtype``: a deployment's compute dtype
        world = world or World()
        self.cfg = cfg
        self.model = Qwen3Body(cfg, world, group)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, tied_to=tied, world=world, group=group
        )
        self.info = ModelInfo(
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position,
            eos_token_ids=cfg.eos_token_ids,
            bos_token_id=cfg.bos_token_id,
            dtype=cfg.dtype,
            hybrid=False,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model.embed_tokens(batch.input_ids)
        layers = self.model.layers
        x, residual = layers[0].input_layernorm(hidden), hidden
        for i, layer in enumerate(layers):
            out, residual = layer(x, residual, batch)
            if i + 1 < len(layers):
                x, residual = add_rms_norm(out, residual, layers[i + 1].input_layernorm)
        # only the rows that are sampled from need the last residual add and the final norm
        rows = batch.logits_indices
        return add_rms_norm(out[rows], residual[rows], self.model.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
