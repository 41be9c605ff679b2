"""HF ``config.json`` of a ``glm4_moe`` checkpoint (GLM-4.5/4.6/4.7) -> a typed architecture config.

Values this family does not implement are refused by key name rather than guessed around: a RoPE
scaling we do not compute, an activation other than SiLU, a routing shape the router cannot honour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dgpp.plugin_api import CausalLMFields, ConfigKeys

# Keys that change what the model computes and that this family does not implement when set.
_MUST_BE_UNSET = ("rope_scaling", "sliding_window", "layer_types", "mlp_layer_types")


@dataclass(frozen=True, kw_only=True)
class GlmMoeFields(CausalLMFields):
    """What every GLM config carries: the stack's sizes, GLM's sigmoid-routed MoE (``build_glm_moe`` reads it),
    the MTP layer count, the head and the token ids (GLM-4.x's and GLM-5.3's configs add their attention)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float
    attention_bias: bool
    rope_theta: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_mtp_layers: int
    quant_method: str | None = None  # e.g. 'modelopt' (NVFP4) for nvidia/GLM-4.7-NVFP4


@dataclass(frozen=True, kw_only=True)
class Glm4MoeArchConfig(GlmMoeFields):
    """Architecture of a GLM-4.x MoE model (``Glm4MoeForCausalLM``): GQA with q/k/v biases, per-head q/k
    RMSNorm, half-split partial RoPE, ``first_k_dense_replace`` dense layers then sigmoid-routed MoE layers
    with a correction bias, group-limited top-k, routed scaling and shared experts; optional MTP layers
    stored after the last decoder layer (``model.layers.{num_hidden_layers + i}``)."""

    num_key_value_heads: int
    head_dim: int
    use_qk_norm: bool
    rotary_dim: int
    first_k_dense_replace: int

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layers below ``first_k_dense_replace`` (and none past the stack) use the dense MLP."""
        return layer_idx >= self.first_k_dense_replace

    @property
    def mtp_layer_indices(self) -> tuple[int, ...]:
        """Checkpoint indices of the MTP layers (they follow the decoder stack)."""
        return tuple(self.num_hidden_layers + i for i in range(self.num_mtp_layers))

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Glm4MoeArchConfig:
        """Validate config.json (as a dict) and return the typed config; ConfigError names the key."""
        cfg = dict(hf_config)
        keys = ConfigKeys(cfg, "glm4_moe config.json")
        for key in _MUST_BE_UNSET:
            if cfg.get(key) not in (None, {}, []):
                raise keys.error(f"{key!r}={cfg[key]!r} is not supported by dgpp-glm")
        shared = shared_fields(keys, max_position=131072)
        heads = keys.positive("num_attention_heads")
        kv_heads = keys.positive("num_key_value_heads")
        if heads % kv_heads:
            raise keys.error(
                f"'num_attention_heads'={heads} is not a multiple of 'num_key_value_heads'={kv_heads}"
            )
        head_dim = keys.positive("head_dim", shared["hidden_size"] // heads)
        experts = keys.positive("n_routed_experts")
        top_k = keys.positive("num_experts_per_tok")
        n_group = keys.positive("n_group", 1)
        topk_group = keys.positive("topk_group", 1)
        if experts % n_group:
            raise keys.error(f"'n_routed_experts'={experts} is not a multiple of 'n_group'={n_group}")
        if topk_group > n_group:
            raise keys.error(f"'topk_group'={topk_group} exceeds 'n_group'={n_group}")
        per_group = experts // n_group
        if n_group > 1 and per_group < 2:  # a group is scored by the sum of its two best experts
            raise keys.error(f"'n_group'={n_group} leaves {per_group} expert per group (need >= 2)")
        if top_k > topk_group * per_group:
            raise keys.error(
                f"'num_experts_per_tok'={top_k} exceeds the {topk_group * per_group} experts "
                f"that 'topk_group'={topk_group} groups offer"
            )
        mtp = keys.optional("num_nextn_predict_layers", int, 0)
        if mtp < 0:
            raise keys.error(f"'num_nextn_predict_layers'={mtp} must be >= 0")
        first_dense = keys.optional("first_k_dense_replace", int, 1)
        if first_dense < 0:
            raise keys.error(f"'first_k_dense_replace'={first_dense} must be >= 0")
        return cls(
            **shared,
            num_hidden_layers=keys.positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            use_qk_norm=keys.optional("use_qk_norm", bool, False),
            rope_theta=keys.rope(supported=("default",)).theta,
            rotary_dim=keys.rotary_dim(head_dim, default_factor=0.5),
            first_k_dense_replace=first_dense,
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            n_group=n_group,
            topk_group=topk_group,
            num_mtp_layers=mtp,
        )


def _quant_method(cfg: dict[str, Any]) -> str | None:
    """The shipped weight format's method; dgpp.quant resolves it per module (and refuses unknown ones)."""
    from dgpp.plugin_api import QuantScheme

    scheme = QuantScheme.from_hf_config(cfg)
    return None if scheme is None else scheme.method


def shared_fields(keys: ConfigKeys, max_position: int) -> dict[str, Any]:
    """The ``GlmMoeFields`` that GLM-4.x and GLM-5.3 read by the same rules (each parser reads and checks the
    rest: layer and head counts, expert groups, MTP layers, RoPE); ``max_position`` when config.json has none."""
    keys.only("hidden_act", "silu")
    return {
        "vocab_size": keys.positive("vocab_size"),
        "hidden_size": keys.positive("hidden_size"),
        "intermediate_size": keys.positive("intermediate_size"),
        "moe_intermediate_size": keys.positive("moe_intermediate_size"),
        "rms_norm_eps": keys.optional("rms_norm_eps", float, 1e-5),
        "attention_bias": keys.optional("attention_bias", bool, False),
        "n_shared_experts": keys.optional("n_shared_experts", int, 1),
        "norm_topk_prob": keys.optional("norm_topk_prob", bool, True),
        "routed_scaling_factor": keys.optional("routed_scaling_factor", float, 1.0),
        **keys.causal_lm_fields(max_position),
        "quant_method": _quant_method(keys.cfg),
    }
