"""Full GLM-5.3 (``GlmMoeDsaForCausalLM`` / ``glm_moe_dsa``): MLA with DeepSeek sparse attention, GLM's MoE.

Pre-norm blocks: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``. Attention is core MLA over a
latent cache (``dgpp.nn.mla``) restricted per row to the tokens a DSA indexer picks (``dgpp.nn.dsa``):
``full`` layers run their own indexer (and cache its keys), ``shared`` layers reuse the selection of the
layer before them. RoPE is interleaved-pair on the MLA rope dims and on the indexer's first dims. The
MLP is dense in ``mlp_layer_types == 'dense'`` layers, else GLM-4.7's sigmoid-routed MoE (correction
bias, routed scaling, shared expert).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.nn.decoder import DecoderStack
from dgpp.nn.dsa import DSAIndexer
from dgpp.nn.mla import MultiLatentAttention, mla_softmax_scale
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.norm import RMSNorm
from dgpp.nn.parallel import all_reduce
from dgpp.nn.rotary import rotary_embedding
from dgpp.nn.selection import Selection
from dgpp.plugin_api import CacheSpec, ForwardBatch, World
from dgpp_glm.glm5_config import GlmMoeDsaArchConfig
from dgpp_glm.model import Glm4MoeForCausalLM, build_glm_moe


class GlmMoeDsaAttention(MultiLatentAttention):
    """``self_attn.*``: MLA plus, on ``full`` layers, its ``indexer``. ``name`` (the cache entry) and
    ``indexer`` default to the stack's layer ``layer_idx``; the MTP block past the stack states both."""

    def __init__(
        self,
        cfg: GlmMoeDsaArchConfig,
        layer_idx: int,
        *,
        dtype: torch.dtype,
        world: World,
        name: str | None = None,
        indexer: bool | None = None,
    ) -> None:
        name = name or f"layers.{layer_idx}.self_attn"
        rope = cfg.qk_rope_head_dim
        super().__init__(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
            cfg.qk_nope_head_dim,
            rope,
            cfg.v_head_dim,
            rotary_embedding(cfg.rope, rope, style="interleaved"),
            name,
            dtype=dtype,
            scale=mla_softmax_scale(cfg.qk_nope_head_dim + rope, cfg.yarn),
            norm_eps=1e-6,
            bias=cfg.attention_bias,
            world=world,
        )
        self.indexer = None
        if cfg.runs_indexer(layer_idx) if indexer is None else indexer:
            index_rotary = rotary_embedding(cfg.rope, cfg.index_head_dim, rope, style="interleaved")
            self.indexer = DSAIndexer(
                cfg.hidden_size,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.index_topk,
                index_rotary,
                name + ".indexer",
                dtype=dtype,
            )
        self.reuses_selection = True  # shared layers attend over the previous layer's picks (False: dense)

    def cache_entries(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        """The layer's latent entry and, with an indexer, its keys, in the layer's own dtype (the model's and the
        drafter's ``cache_spec`` collect them)."""
        spec: dict[str, CacheSpec] = {self.cache_name: self.cache_spec()}
        if self.indexer is not None:
            spec[self.indexer.cache_name] = self.indexer.cache_spec()
        return spec

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, previous: Selection | None
    ) -> tuple[torch.Tensor, Selection | None]:
        query = self.prepare(x, batch)
        if self.indexer is not None:
            selection = self.indexer(x, query.q_resid, batch)
        else:
            selection = previous if self.reuses_selection else None
        return self.attend(query, batch, selection), selection


class GlmMoeDsaDecoderLayer(nn.Module):
    """One pre-norm block; ``name`` / ``indexer`` / ``moe`` default to what the config says of layer ``layer_idx``."""

    def __init__(
        self,
        cfg: GlmMoeDsaArchConfig,
        layer_idx: int,
        *,
        dtype: torch.dtype,
        world: World,
        name: str | None = None,
        indexer: bool | None = None,
        moe: bool | None = None,
    ) -> None:
        super().__init__()
        self.world = world
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = GlmMoeDsaAttention(
            cfg, layer_idx, dtype=dtype, world=world, name=name, indexer=indexer
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(layer_idx) if moe is None else moe:
            self.mlp = build_glm_moe(cfg, dtype=dtype, world=world)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, world=world)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, previous: Selection | None, group: Any = None):
        attn, selection = self.self_attn(self.input_layernorm(x), batch, previous)
        h = x + all_reduce(attn, self.world, group)
        return h + all_reduce(self.mlp(self.post_attention_layernorm(h)), self.world, group), selection


class GlmMoeDsaForCausalLM(Glm4MoeForCausalLM):
    """Full GLM-5.3 behind the engine's model contract (head, info and forward as GLM-4.7's); per layer a latent
    cache, plus indexer keys on ``full`` layers."""

    @classmethod
    def build_stack(cls, cfg: GlmMoeDsaArchConfig, *, dtype: torch.dtype, world: World) -> DecoderStack:
        layers = (
            GlmMoeDsaDecoderLayer(cfg, i, dtype=dtype, world=world) for i in range(cfg.num_hidden_layers)
        )
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        return DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, norm, dtype=dtype)

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        selection: Selection | None = None
        for layer in self.model.layers:
            x, selection = layer(x, batch, selection, self.group)
        return self.model.norm(x)
