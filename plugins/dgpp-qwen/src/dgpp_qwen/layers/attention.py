"""Qwen full attention: the shared ``dgpp.nn.gqa.GQAttention`` block configured from a ``QwenConfig``
(q/k/v/o biases per ``attention_bias``, per-head q/k RMSNorm, (partial) rotate-half RoPE, and for Qwen3.5
the ``[q|gate]`` q_proj with a sigmoid output gate).

Qwen3 / Qwen3-MoE use it with ``output_gate=False, zero_centered_norm=False``; the Qwen3.5 hybrids
with both True.
"""

from __future__ import annotations

from dgpp.nn.gqa import GQAttention
from dgpp.nn.rotary import RotaryEmbedding, rotary_embedding
from dgpp.plugin_api import World
from dgpp_qwen.config import QwenConfig


def build_rotary(cfg: QwenConfig) -> RotaryEmbedding:
    rope = cfg.rope
    return rotary_embedding(
        rope.scaling,
        cfg.head_dim,
        rope.rotary_dim,
        style="half",
        mrope_section=rope.mrope_section,
        mrope_interleaved=rope.mrope_interleaved,
    )


class QwenAttention(GQAttention):
    """One full-attention layer; its K/V live in the pool entry named ``cache_name``."""

    def __init__(
        self,
        cfg: QwenConfig,
        cache_name: str,
        rotary: RotaryEmbedding,
        *,
        output_gate: bool = False,
        zero_centered_norm: bool = False,
        world: World | None = None,
    ) -> None:
        super().__init__(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            rotary,
            cache_name,
            dtype=cfg.dtype,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm=True,
            zero_centered_norm=zero_centered_norm,
            output_gate=output_gate,
            norm_eps=cfg.rms_norm_eps,
            world=world,
        )
