"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): the forward pass over the engine's caches.

Pre-norm decoder blocks. Attention: GQA with q/k heads of ``head_dim`` and narrower v heads (``v_head_dim``);
RoPE (rotate-half) on the first ``rotary_dim`` dims of q and k with a theta per layer type; v scaled by
``attention_value_scale`` before it is cached, so the cache holds what the attention reads. Sliding-window
layers have their own KV head count, a learned sink logit per query head, and keep K/V in a ring of
``sliding_window - 1`` positions per request; full-attention layers keep theirs in the shared paged pool.
MLP: dense SwiGLU where ``mlp_layer_types`` says ``dense``, elsewhere a sigmoid-routed MoE (fp32 router with
a correction bias for the choice, renormalized top-k, no shared expert). Module names follow the
checkpoint's tensor names.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from dgpp.nn.decoder import DecoderStack, PreNormBlock, PreNormCausalLM, dense_or_moe
from dgpp.nn.gqa import project_qkv
from dgpp.nn.linear import Linear
from dgpp.nn.moe import RoutingConfig, SparseMoE, TopKRouter
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import rotary_embedding
from dgpp.nn.sliding_attention import SinkAttention
from dgpp.nn.sources import Alternatives, Source
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.plugin_api import ForwardBatch, World
from dgpp_mimo.config import MimoArchConfig


class MimoAttention(nn.Module):
    """``o_proj(attn(rope(q), rope(k), v · value_scale; sinks?))`` for one layer, shaped by its layer type."""

    def __init__(self, cfg: MimoArchConfig, layer_idx: int, *, dtype: torch.dtype, world: World) -> None:
        super().__init__()
        shape = cfg.shape(layer_idx)
        heads, kv_heads = shape.num_heads, shape.num_kv_heads
        if heads % world.size or kv_heads % world.size:
            raise ValueError(
                f"layer {layer_idx}: {heads} q / {kv_heads} kv heads do not split over TP world {world.size}"
            )
        self.num_heads, self.num_kv_heads = heads // world.size, kv_heads // world.size
        self.head_dim, self.v_head_dim = shape.head_dim, shape.v_head_dim
        self.value_scale = cfg.attention_value_scale
        column = partial(Linear, bias=cfg.attention_bias, dtype=dtype, parallel="column", world=world)
        self.q_proj = column(cfg.hidden_size, heads * shape.head_dim)
        self.k_proj = column(cfg.hidden_size, kv_heads * shape.head_dim)
        self.v_proj = column(cfg.hidden_size, kv_heads * shape.v_head_dim)
        self.o_proj = Linear(
            heads * shape.v_head_dim, cfg.hidden_size, dtype=dtype, parallel="row", world=world
        )
        if shape.sinks:  # one logit per query head, kept in fp32; TP splits it with the heads
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(self.sinks, weight_loader=default_weight_loader, tp_dim=0, world=world)
        else:
            self.register_parameter("sinks", None)
        self.rotary = rotary_embedding(shape.rope, shape.head_dim, shape.rotary_dim, style="half")
        # the layer's cache entry (paged K/V, or its ring) is declared by SinkAttention under this name
        self.attn = SinkAttention(
            f"layers.{layer_idx}.self_attn",
            self.num_heads,
            self.num_kv_heads,
            shape.head_dim,
            window=cfg.sliding_window if cfg.is_sliding(layer_idx) else None,
            v_head_dim=shape.v_head_dim,
        )

    def checkpoint_sources(self) -> dict[str, Alternatives]:
        """MiMo releases call the sink ``attention_sink_bias``; transformers renames it ``sinks``: read either."""
        return {"sinks": [[Source("attention_sink_bias")], [Source("sinks")]]}

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = x.shape[0]
        # on CUDA q, k and v in one launch; the CPU keeps one product per projection
        q, k, v = project_qkv(x, (self.q_proj, self.k_proj, self.v_proj), fuse_on_cpu=False)
        q = q.view(rows, self.num_heads, self.head_dim)
        k = k.view(rows, self.num_kv_heads, self.head_dim)
        v = v.view(rows, self.num_kv_heads, self.v_head_dim) * self.value_scale
        q, k = self.rotary(batch.positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch, self.sinks))


def build_mimo_moe(cfg: MimoArchConfig, *, dtype: torch.dtype, world: World) -> SparseMoE:
    """Sigmoid scores from an fp32 router (weight and correction bias kept in fp32 as the checkpoint ships
    them); the bias steers the choice only, the weights are the renormalized scores; no shared expert."""
    routing = RoutingConfig(
        num_experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        scoring="sigmoid",
        renormalize=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        correction_bias=True,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        router_fp32=True,
    )
    moe = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, routing, dtype=dtype, world=world)
    moe.gate = TopKRouter(cfg.hidden_size, routing, dtype=torch.float32)
    return moe


def build_layer(cfg: MimoArchConfig, layer_idx: int, *, dtype: torch.dtype, world: World) -> PreNormBlock:
    """One pre-norm block; the MLP dense or MoE by ``mlp_layer_types``."""
    mlp = dense_or_moe(
        cfg, layer_idx, partial(build_mimo_moe, cfg, dtype=dtype, world=world), dtype=dtype, world=world
    )
    return PreNormBlock(
        RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
        MimoAttention(cfg, layer_idx, dtype=dtype, world=world),
        RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
        mlp,
        world,
    )


class MimoV2FlashForCausalLM(PreNormCausalLM[MimoArchConfig]):
    """The MiMo model behind the engine's model contract; hybrid when any layer slides (its rings are state)."""

    def __init__(
        self,
        cfg: MimoArchConfig,
        *,
        dtype: torch.dtype | None = None,
        world: World | None = None,
        group: Any = None,
    ) -> None:
        dtype, world = dtype or cfg.dtype, world or World()
        layers = (build_layer(cfg, i, dtype=dtype, world=world) for i in range(cfg.num_hidden_layers))
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        super().__init__(
            cfg,
            DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, norm, dtype=dtype),
            dtype=dtype,
            world=world,
            group=group,
            hybrid="sliding_attention" in cfg.layer_types,
        )

    def activation_bytes_per_token(self) -> int:
        """A prefill row: the residual and normed input, the widest layer's q/k/v/attention rows and the widest
        MLP's gate/up/activation on this rank (MiMo's layer types differ in heads and head widths)."""
        cfg, world = self.config, self.world.size
        widest_mlp = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.num_experts_per_tok)
        widest_attn = max(s.num_heads * (2 * s.head_dim + s.v_head_dim) for s in cfg.attention.values())
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return (4 * cfg.hidden_size + (widest_attn + 3 * widest_mlp) // world) * itemsize
