"""Flint (``FlintForCausalLM``): the forward pass over the engine's caches.

Pre-norm decoder blocks. Attention: GQA with per-head q/k RMSNorm and a learned sink logit per query head on
every layer; sliding-window layers rotate q/k (RoPE over the whole head) and keep their K/V in a ring of
``sliding_window - 1`` positions per request; full-attention layers use no positional encoding and keep their
K/V in the shared paged pool. MLP: dense SwiGLU on ``mlp_only_layers``, elsewhere a sigmoid-routed MoE
(renormalized top-k, fp32 router) plus an ungated shared expert added in full. Module names follow the
checkpoint's tensor names (the sinks read either of their two names: ``checkpoint_sources``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from dgpp.nn.decoder import DecoderStack, PreNormBlock, PreNormCausalLM, dense_or_moe
from dgpp.nn.gqa import norm_and_rotate, project_qkv
from dgpp.nn.linear import Linear
from dgpp.nn.moe import RoutingConfig, SparseMoE, TopKRouter
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RopeScaling, rotary_embedding
from dgpp.nn.sliding_attention import SinkAttention
from dgpp.nn.sources import Alternatives, Source
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.plugin_api import ForwardBatch, World
from dgpp_flint.config import FlintArchConfig


class FlintRMSNorm(RMSNorm):
    """``(w · x̂)`` with the product in fp32, rounded once (transformers' Flint / gpt-oss order; Llama rounds
    ``x̂`` first). The same numbers as ``RMSNorm`` in fp32, different bits in bf16."""

    fp32_product = True


class FlintAttention(nn.Module):
    """``o_proj(attn(rope?(q_norm(q)), rope?(k_norm(k)), v; sinks))`` for one layer (RoPE on sliding layers only)."""

    def __init__(self, cfg: FlintArchConfig, layer_idx: int, *, dtype: torch.dtype, world: World) -> None:
        super().__init__()
        if cfg.num_attention_heads % world.size or cfg.num_key_value_heads % world.size:
            raise ValueError(
                f"{cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv heads do not split over "
                f"TP world {world.size}"
            )
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads // world.size, kv_heads // world.size, dim
        self.q_proj = Linear(cfg.hidden_size, heads * dim, dtype=dtype, parallel="column", world=world)
        self.k_proj = Linear(cfg.hidden_size, kv_heads * dim, dtype=dtype, parallel="column", world=world)
        self.v_proj = Linear(cfg.hidden_size, kv_heads * dim, dtype=dtype, parallel="column", world=world)
        self.o_proj = Linear(heads * dim, cfg.hidden_size, dtype=dtype, parallel="row", world=world)
        self.q_norm = FlintRMSNorm(dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = FlintRMSNorm(dim, cfg.rms_norm_eps, dtype=dtype)
        # one logit per query head, kept in fp32 as the checkpoint ships it; TP splits it with the heads
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.sinks, weight_loader=default_weight_loader, tp_dim=0, world=world)
        sliding = cfg.is_sliding(layer_idx)
        self.rotary = (
            rotary_embedding(RopeScaling(theta=cfg.rope_theta), dim, style="half") if sliding else None
        )
        # the layer's cache entry (paged K/V, or its ring) is declared by SinkAttention under this name
        self.attn = SinkAttention(
            f"layers.{layer_idx}.self_attn",
            self.num_heads,
            self.num_kv_heads,
            dim,
            window=cfg.sliding_window if sliding else None,
        )

    def checkpoint_sources(self) -> dict[str, Alternatives]:
        """Flint releases call the sink ``softmax_offset``; transformers renames it ``sinks``: read either."""
        return {"sinks": [[Source("softmax_offset")], [Source("sinks")]]}

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = x.shape[0]
        # on CUDA q, k and v in one launch, then the norms and the rotation in one; the CPU keeps its products
        q, k, v = project_qkv(x, (self.q_proj, self.k_proj, self.v_proj), fuse_on_cpu=False)
        q = q.view(rows, self.num_heads, self.head_dim)
        k = k.view(rows, self.num_kv_heads, self.head_dim)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        q, k = norm_and_rotate(q, k, batch.positions, self.q_norm, self.k_norm, self.rotary)
        return self.o_proj(self.attn(q, k, v, batch, self.sinks))


def build_flint_moe(cfg: FlintArchConfig, *, dtype: torch.dtype, world: World) -> SparseMoE:
    """Sigmoid scores from an fp32 router (its weight kept in fp32), top-k on the scores, renormalized; the
    shared expert is added without a gate."""
    routing = RoutingConfig(
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        scoring="sigmoid",
        renormalize=cfg.norm_topk_prob,
        router_fp32=True,
    )
    moe = SparseMoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        routing,
        dtype=dtype,
        shared_intermediate_size=cfg.shared_expert_intermediate_size,
        world=world,
    )
    moe.gate = TopKRouter(cfg.hidden_size, routing, dtype=torch.float32)
    return moe


def build_layer(cfg: FlintArchConfig, layer_idx: int, *, dtype: torch.dtype, world: World) -> PreNormBlock:
    """One pre-norm block; the MLP dense or MoE by index."""
    mlp = dense_or_moe(
        cfg, layer_idx, partial(build_flint_moe, cfg, dtype=dtype, world=world), dtype=dtype, world=world
    )
    return PreNormBlock(
        FlintRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
        FlintAttention(cfg, layer_idx, dtype=dtype, world=world),
        FlintRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
        mlp,
        world,
    )


class FlintForCausalLM(PreNormCausalLM[FlintArchConfig]):
    """The Flint model behind the engine's model contract. Hybrid when any layer slides: the rings are
    per-request state, so the prefix cache attaches only where it holds a state snapshot."""

    def __init__(
        self,
        cfg: FlintArchConfig,
        *,
        dtype: torch.dtype | None = None,
        world: World | None = None,
        group: Any = None,
    ) -> None:
        dtype, world = dtype or cfg.dtype, world or World()
        layers = (build_layer(cfg, i, dtype=dtype, world=world) for i in range(cfg.num_hidden_layers))
        norm = FlintRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        super().__init__(
            cfg,
            DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, norm, dtype=dtype),
            dtype=dtype,
            world=world,
            group=group,
            hybrid="sliding_attention" in cfg.layer_types,
        )
