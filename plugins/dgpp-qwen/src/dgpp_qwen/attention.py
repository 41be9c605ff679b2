"""Qwen full-attention block: q/k/v projections, per-head q/k RMSNorm, (partial) rotate-half RoPE,
paged attention, and for Qwen3.5 the ``[q|gate]`` q_proj with a sigmoid output gate.

Qwen3 / Qwen3-MoE use it with ``output_gate=False, zero_centered_norm=False``; the Qwen3.5 hybrids
with both True.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.engine.batch import ForwardBatch
from dgpp.family import World
from dgpp.nn.attention import PagedAttention, gated_output, split_query_gate
from dgpp.nn.linear import Linear
from dgpp.nn.mlp import dense_weights
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RotaryEmbedding
from dgpp_qwen.config import QwenConfig


def build_rotary(cfg: QwenConfig) -> RotaryEmbedding:
    rope = cfg.rope
    return RotaryEmbedding(cfg.head_dim, rope.rotary_dim, rope.theta, style="half", yarn=rope.yarn, mrope_section=rope.mrope_section)


class QwenAttention(nn.Module):
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
        super().__init__()
        world = world or World()
        if cfg.num_heads % world.size or cfg.num_kv_heads % world.size:
            raise ValueError(f"{cfg.num_heads} q / {cfg.num_kv_heads} kv heads do not split over world {world.size}")
        self.num_heads = cfg.num_heads // world.size
        self.num_kv_heads = cfg.num_kv_heads // world.size
        self.head_dim = cfg.head_dim
        self.output_gate = output_gate
        dtype, bias, d = cfg.dtype, cfg.attention_bias, cfg.head_dim
        q_out = cfg.num_heads * d * (2 if output_gate else 1)
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=bias, dtype=dtype, parallel="column", world=world)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias, dtype=dtype, parallel="column", world=world)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias, dtype=dtype, parallel="column", world=world)
        self.o_proj = Linear(cfg.num_heads * d, cfg.hidden_size, bias=bias, dtype=dtype, parallel="row", world=world)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centered=zero_centered_norm, dtype=dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centered=zero_centered_norm, dtype=dtype)
        self.rotary = rotary
        self.attn = PagedAttention(cache_name, self.num_heads, self.num_kv_heads, d)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if x.is_cuda and dense_weights(*projections):  # decode rows: q, k and v in one Triton launch
            from dgpp import kernels

            weights = [p.weight for p in projections]
            if kernels.gemv_applies(x, *weights):
                q, k, v = kernels.multi_linear(x, weights)
                return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = x.shape[0]
        q_out, k_out, v_out = self._project(x)
        if self.output_gate:
            q, gate = split_query_gate(q_out, self.num_heads, self.head_dim)
        else:
            q, gate = q_out.view(rows, self.num_heads, self.head_dim), None
        k = k_out.view(rows, self.num_kv_heads, self.head_dim)
        v = v_out.view(rows, self.num_kv_heads, self.head_dim)
        rot = self.rotary.rotary_dim
        if x.is_cuda and rot & (rot - 1) == 0:  # q/k norm + RoPE in one Triton launch
            from dgpp import kernels

            q, k = kernels.fused_qk_norm_rope(
                q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                1.0 if self.q_norm.zero_centered else 0.0, batch.positions, self.rotary.inv_freq,
                self.rotary.magnitude, is_neox=self.rotary.style == "half",
            )
        else:
            q, k = self.rotary(batch.positions, self.q_norm(q), self.k_norm(k))
        out = self.attn(q, k, v, batch)
        if gate is not None:
            out = gated_output(out, gate)
        return self.o_proj(out)
