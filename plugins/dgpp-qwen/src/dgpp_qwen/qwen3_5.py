"""Qwen3.5 hybrids: ``qwen3_5`` (Qwen3.8-27B, dense SwiGLU) and ``qwen3_5_moe`` (Qwen3.5-122B-A10B, routed experts
plus a sigmoid-gated shared expert).

Layers follow the config's ``layer_types``: ``linear_attention`` layers are Gated DeltaNet token mixers
(per-request conv + recurrent state), ``full_attention`` layers are GQA over the paged K/V pool with a
``[q|gate]`` q_proj, per-head zero-centred q/k RMSNorm, rotate-half RoPE on the first
``partial_rotary_factor`` of each head (mRoPE collapses to 1-D for text) and a sigmoid output gate.
Every norm outside the GDN output norm is zero-centred ``(1+w)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dgpp.nn.decoder import stream_blocks
from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.gated_deltanet import GatedDeltaNet
from dgpp.nn.norm import RMSNorm, add_rms_norm
from dgpp.nn.parallel import all_reduce
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.plugin_api import CacheSpec, ConfigError, ForwardBatch, Model, ModelInfo, PagedKV, World
from dgpp_qwen.config import QwenConfig
from dgpp_qwen.layers.attention import QwenAttention, build_rotary
from dgpp_qwen.qwen3 import build_mlp

LINEAR_ATTENTION = "linear_attention"


def layer_cache_name(index: int) -> str:
    return f"layers.{index}"


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated full attention), then the MLP or MoE. Under TP both
    sublayers end row-parallel, so each output is all-reduced once before its residual add."""

    def __init__(
        self,
        cfg: QwenConfig,
        index: int,
        rotary: RotaryEmbedding,
        world: World,
        group: Any,
        cache_name: str | None = None,
    ) -> None:
        super().__init__()
        self.world, self.group = world, group
        self.layer_type = cfg.layer_types[index]
        self.cache_name = cache_name = cache_name or layer_cache_name(
            index
        )  # the pool entry of its K/V or state
        if self.layer_type == LINEAR_ATTENTION:
            gdn = cfg.linear_attn
            if gdn is None:
                raise ConfigError(
                    f"config.json: layer_types[{index}] = 'linear_attention' needs a qwen3_5 model_type"
                )
            self.linear_attn = GatedDeltaNet(
                cache_name,
                hidden_size=cfg.hidden_size,
                num_k_heads=gdn.num_key_heads,
                num_v_heads=gdn.num_value_heads,
                head_k_dim=gdn.key_head_dim,
                head_v_dim=gdn.value_head_dim,
                conv_kernel=gdn.conv_kernel,
                eps=cfg.rms_norm_eps,
                dtype=cfg.dtype,
                world=world,
            )
        else:
            self.self_attn = QwenAttention(
                cfg, cache_name, rotary, output_gate=True, zero_centered_norm=True, world=world
            )
        self.mlp = build_mlp(cfg, index, world)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, dtype=cfg.dtype)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, dtype=cfg.dtype
        )

    def cache_entries(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        """The layer's one entry: GDN state or paged K/V (the model's and the drafter's ``cache_spec`` collect it)."""
        if self.layer_type == LINEAR_ATTENTION:
            return {self.cache_name: self.linear_attn.cache_spec()}
        attn = self.self_attn
        return {
            self.cache_name: PagedKV(
                num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, dtype=dtype, fp8_rows=True
            )
        }

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        out, hidden = self.sublayers(self.input_layernorm(hidden), hidden, batch)
        return hidden + out

    def sublayers(
        self, normed: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, stream after the mixer's add)`` from the normed input and the stream before the layer
        (``dgpp.nn.decoder.stream_blocks``); the layer's output is their sum."""
        mixer = self.linear_attn if self.layer_type == LINEAR_ATTENTION else self.self_attn
        mixed = all_reduce(mixer(normed, batch), self.world, self.group)
        x, residual = add_rms_norm(mixed, residual, self.post_attention_layernorm)
        return all_reduce(self.mlp(x), self.world, self.group), residual


class Qwen35TextStack(nn.Module):
    """``embed_tokens`` -> decoder layers -> final norm (the checkpoint's ``model.`` or
    ``model.language_model.`` prefix)."""

    def __init__(self, cfg: QwenConfig, world: World, group: Any) -> None:
        super().__init__()
        rotary = build_rotary(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, world, group) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, dtype=cfg.dtype)


class Qwen35ForCausalLM(Model):
    """The text model of Qwen3.5 / Qwen3.8-27B / Qwen3.5-122B-A10B. The vision tower is not loaded; the ``mtp.*``
    weights load separately, as the drafter (``qwen3_5_mtp.py``).

    Hidden state is replicated at every block boundary; GDN and attention heads, MLP and expert intermediate
    dims are split over ``world``; the embedding is replicated, the head vocab-parallel.

    ``last_hidden`` (while ``keep_hidden`` is on) is the DFlash2 drafter's features when ``feature_layers`` names
    layers (``dgpp_qwen.dflash2``): per row, the outputs of those layers concatenated in that order; else the
    final normed hidden (the MTP drafter's)."""

    #: the layers whose outputs are kept (set by the DFlash2 drafter)
    feature_layers: tuple[int, ...] = ()

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
        self.world, self.group = world, group
        self.model = Qwen35TextStack(cfg, world, group)
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
            hybrid=any(t == LINEAR_ATTENTION for t in cfg.layer_types),
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model.embed_tokens(batch.input_ids)
        features = self.feature_layers if self.keep_hidden else ()
        # every row is normed (the same ops whether or not a drafter listens, so MTP never changes the logits);
        # the rows stay for the drafter (it drafts from each position, prompt included) only if it is on
        hidden, outputs = stream_blocks(
            hidden,
            list(self.model.layers),
            self.model.norm,
            lambda layer, h, r: layer.sublayers(h, r, batch),
            features,
        )
        self.keep_last_hidden(torch.cat([outputs[i] for i in features], dim=-1) if features else hidden)
        return hidden[batch.logits_indices]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
