"""GLM-4.x MoE (``Glm4MoeForCausalLM``): the forward pass over the engine's paged KV.

Pre-norm decoder blocks on core's skeleton (``dgpp.nn.decoder``): GQA attention with q/k/v biases, per-head
q/k RMSNorm and half-split RoPE on the first ``rotary_dim`` dims of each head; then a SwiGLU MLP in the first
``first_k_dense_replace`` layers and a sigmoid-routed MoE (correction bias, group-limited top-k, routed
scaling, shared experts) after. Module names follow the checkpoint's tensor names, so loading is a
name-to-parameter walk.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from dgpp.nn.decoder import DecoderStack, PreNormBlock, PreNormCausalLM, dense_or_moe
from dgpp.nn.gqa import GQAttention
from dgpp.nn.moe import RoutingConfig, SparseMoE
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RopeScaling, rotary_embedding
from dgpp.plugin_api import World
from dgpp_glm.config import Glm4MoeArchConfig, GlmMoeFields


def checkpoint_name(name: str) -> str:
    """dgpp's shared MoE calls its shared expert ``shared_expert``; GLM checkpoints say ``shared_experts``."""
    return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


def build_glm_moe(
    cfg: GlmMoeFields, *, dtype: torch.dtype, world: World, swiglu_limit: float | None = None
) -> SparseMoE:
    """GLM's MoE on the shared layer: fp32 sigmoid router, expert choice on score + correction bias
    within the best ``topk_group`` of ``n_group`` groups, weights = renormalized unbiased scores times
    ``routed_scaling_factor``; plus ``n_shared_experts`` ungated shared experts fused into one MLP.
    ``swiglu_limit`` (GLM-5.3-Flash): clamp the routed and shared experts' SwiGLU inputs."""
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
    return SparseMoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        routing,
        dtype=dtype,
        shared_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        world=world,
        swiglu_limit=swiglu_limit,
    )


def build_attention(
    cfg: Glm4MoeArchConfig, cache_name: str, *, dtype: torch.dtype, world: World
) -> GQAttention:
    """GLM's GQA: q/k/v biases, per-head q/k norm before RoPE, half-split RoPE on the first ``rotary_dim``
    dims of each head (64 of 128 in GLM-4.7)."""
    rotary = rotary_embedding(RopeScaling(theta=cfg.rope_theta), cfg.head_dim, cfg.rotary_dim, style="half")
    return GQAttention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        rotary,
        cache_name,
        dtype=dtype,
        qkv_bias=cfg.attention_bias,
        qk_norm=cfg.use_qk_norm,
        norm_eps=cfg.rms_norm_eps,
        world=world,
    )


class Glm4MoeDecoderLayer(PreNormBlock):
    """One pre-norm block: ``h = x + attn(norm(x))``; ``out = h + mlp(norm(h))`` (dense or MoE by index)."""

    def __init__(
        self, cfg: Glm4MoeArchConfig, layer_idx: int, cache_name: str, *, dtype: torch.dtype, world: World
    ) -> None:
        input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self_attn = build_attention(cfg, cache_name, dtype=dtype, world=world)
        post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        mlp = dense_or_moe(
            cfg, layer_idx, partial(build_glm_moe, cfg, dtype=dtype, world=world), dtype=dtype, world=world
        )
        super().__init__(input_layernorm, self_attn, post_attention_layernorm, mlp, world)


class Glm4MoeForCausalLM(PreNormCausalLM[GlmMoeFields]):
    """The GLM-4.x MoE model behind the engine's model contract.

    With ``keep_hidden`` on, ``forward`` keeps the post-final-norm hidden of every row in ``last_hidden``: GLM's
    MTP layer drafts from it (the vLLM convention; the pre-norm stream halved acceptance in the original engine).
    """

    def __init__(
        self,
        cfg: Glm4MoeArchConfig,
        *,
        dtype: torch.dtype | None = None,
        world: World | None = None,
        group: Any = None,
    ) -> None:
        dtype, world = dtype or cfg.dtype, world or World()
        super().__init__(
            cfg,
            self.build_stack(cfg, dtype=dtype, world=world),
            dtype=dtype,
            world=world,
            group=group,
            extra={"num_mtp_layers": cfg.num_mtp_layers},
        )

    @classmethod
    def build_stack(cls, cfg: Glm4MoeArchConfig, *, dtype: torch.dtype, world: World) -> DecoderStack:
        """``model.*``: the embedding, GLM's blocks and the final norm (GLM-5.3 builds its own blocks)."""
        layers = (
            Glm4MoeDecoderLayer(cfg, i, f"layers.{i}.self_attn", dtype=dtype, world=world)
            for i in range(cfg.num_hidden_layers)
        )
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        return DecoderStack(cfg.vocab_size, cfg.hidden_size, layers, norm, dtype=dtype)
