"""``LlamaForCausalLM`` on dgpp's shared layers: pre-norm blocks (``dgpp.nn.decoder``) of grouped-query attention
(rotate-half RoPE, optional q/k/v/o biases) and a SwiGLU MLP (optional biases), a final RMSNorm and a head that
may be tied to the embedding. Module names follow the HF checkpoints, so loading is a plain name-for-name fill,
and the attention layers declare their own paged K/V entries.
"""

from __future__ import annotations

import torch

from dgpp.nn.decoder import DecoderStack, PreNormBlock, PreNormCausalLM
from dgpp.nn.gqa import GQAttention
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RotaryEmbedding, rotary_embedding
from dgpp.plugin_api import World
from dgpp_llama.config import LlamaConfig


def build_layer(
    cfg: LlamaConfig, layer: int, rotary: RotaryEmbedding, *, dtype: torch.dtype, world: World
) -> PreNormBlock:
    attention = GQAttention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        rotary,
        f"layers.{layer}.self_attn",
        dtype=dtype,
        qkv_bias=cfg.attention_bias,
        o_bias=cfg.attention_bias,
        world=world,
    )
    mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, world=world, bias=cfg.mlp_bias)
    return PreNormBlock(
        RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
        attention,
        RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
        mlp,
        world,
    )


class LlamaForCausalLM(PreNormCausalLM[LlamaConfig]):
    """The Llama text model over the engine's paged K/V pool."""

    def __init__(self, cfg: LlamaConfig, *, dtype: torch.dtype, world: World, group: object = None) -> None:
        rotary = rotary_embedding(cfg.rope, cfg.head_dim)  # one module, shared by every layer
        layers = (build_layer(cfg, i, rotary, dtype=dtype, world=world) for i in range(cfg.num_hidden_layers))
        stack = DecoderStack(
            cfg.vocab_size,
            cfg.hidden_size,
            layers,
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
            dtype=dtype,
        )
        super().__init__(cfg, stack, dtype=dtype, world=world, group=group)
