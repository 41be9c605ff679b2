"""Grouped-query self-attention block over the paged KV: q/k/v projections (optionally biased), optional
per-head q/k RMSNorm, (partial) RoPE, paged attention, ``o_proj``.

The shape Llama-style families share (GLM-4.x, Qwen3): heads split over TP ranks (q/k/v column-, o_proj
row-parallel; the caller all-reduces the output once per block). On CUDA, with q/k norm and a
power-of-two rotary dim, the norm and the rotation run as one Triton launch.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.engine.batch import ForwardBatch
from dgpp.family import World
from dgpp.nn.attention import PagedAttention
from dgpp.nn.linear import Linear
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RotaryEmbedding


class GQAttention(nn.Module):
    """``o_proj(attn(rope(norm(q)), rope(norm(k)), v))`` for one layer; K/V go to pool entry ``cache_name``.

    Parameter names follow HF checkpoints (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
    ``k_norm``). ``qk_norm=False`` leaves ``q_norm``/``k_norm`` as None.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        cache_name: str,
        *,
        dtype: torch.dtype,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        world: World | None = None,
    ) -> None:
        super().__init__()
        world = world or World()
        if num_heads % world.size or num_kv_heads % world.size:
            raise ValueError(f"{num_heads} q / {num_kv_heads} kv heads do not split over TP world {world.size}")
        self.num_heads = num_heads // world.size
        self.num_kv_heads = num_kv_heads // world.size
        self.head_dim = head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=qkv_bias, dtype=dtype, parallel="column", world=world)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias, dtype=dtype, parallel="column", world=world)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias, dtype=dtype, parallel="column", world=world)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, dtype=dtype, parallel="row", world=world)
        self.q_norm = RMSNorm(head_dim, norm_eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps, dtype=dtype) if qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(cache_name, self.num_heads, self.num_kv_heads, head_dim)

    def norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rot = self.rotary.rotary_dim
        if self.q_norm is None:
            return self.rotary(positions, q, k)
        if q.is_cuda and rot & (rot - 1) == 0:  # one launch for both norms and both rotations
            from dgpp.kernels.qk_norm_rope import fused_qk_norm_rope

            return fused_qk_norm_rope(
                q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, 0.0, positions,
                self.rotary.inv_freq, self.rotary.magnitude, is_neox=self.rotary.style == "half",
            )
        return self.rotary(positions, self.q_norm(q), self.k_norm(k))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        q, k = self.norm_and_rotate(q, k, batch.positions)
        return self.o_proj(self.attn(q, k, v, batch))
