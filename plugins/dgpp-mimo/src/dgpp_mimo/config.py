"""HF ``config.json`` of a ``mimo_v2_flash`` checkpoint -> a typed architecture config.

MiMo-V2-Flash (transformers' ``MiMoV2FlashConfig``): GQA with q/k heads of ``head_dim`` (192) and v heads of
``v_head_dim`` (128); ``layer_types`` picks full attention or sliding-window attention per layer, and the
sliding layers have twice the KV heads and a learned sink per query head. RoPE rotates the first
``int(head_dim * partial_rotary_factor)`` dims (rotate-half) with a theta per layer type. Values are scaled by
``attention_value_scale`` before they are cached. ``mlp_layer_types`` picks a dense SwiGLU MLP or a sigmoid-
routed MoE (correction bias for the choice, renormalized top-k, no shared expert). Values this family does
not compute are refused by key name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from dgpp.nn.rotary import RopeScaling
from dgpp.plugin_api import CausalLMFields, ConfigKeys

LAYER_TYPES = ("full_attention", "sliding_attention")
_MLP_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class AttentionShape:
    """The attention of one layer type: head counts and dims, whether it has sinks, its RoPE (the layer type's
    ``rope_parameters`` entry, and how many leading dims of each q/k head rotate)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int  # q and k
    v_head_dim: int
    sinks: bool
    rope: RopeScaling
    rotary_dim: int

    @property
    def rope_theta(self) -> float:
        return self.rope.theta


@dataclass(frozen=True, kw_only=True)
class MimoArchConfig(CausalLMFields):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    attention: dict[str, AttentionShape]  # per layer type present in layer_types
    rms_norm_eps: float
    sliding_window: int  # a row at position p sees p - sliding_window + 1 .. p
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    attention_value_scale: float
    n_routed_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    attention_bias: bool

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "sliding_attention"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == "sparse"

    def shape(self, layer_idx: int) -> AttentionShape:
        return self.attention[self.layer_types[layer_idx]]

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Self:
        """Validate config.json (as a dict) and return the typed config; ConfigError names the key."""
        cfg = dict(hf_config)
        keys = ConfigKeys(cfg, "mimo_v2_flash config.json")
        keys.only("hidden_act", "silu")
        layers = keys.positive("num_hidden_layers")
        layer_types = _types(
            keys,
            "layer_types",
            LAYER_TYPES,
            ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        )
        mlp_types = _types(keys, "mlp_layer_types", _MLP_TYPES, ["dense"] + ["sparse"] * (layers - 1))
        experts = keys.positive("n_routed_experts", 256)
        top_k = keys.positive("num_experts_per_tok", 8)
        if top_k > experts:
            raise keys.error(f"'num_experts_per_tok'={top_k} exceeds 'n_routed_experts'={experts}")
        n_group, topk_group = keys.positive("n_group", 1), keys.positive("topk_group", 1)
        if experts % n_group or topk_group > n_group:
            raise keys.error(f"'n_group'={n_group} / 'topk_group'={topk_group} do not fit {experts} experts")
        return cls(
            vocab_size=keys.positive("vocab_size"),
            hidden_size=keys.positive("hidden_size"),
            intermediate_size=keys.positive("intermediate_size"),
            moe_intermediate_size=keys.positive("moe_intermediate_size", 2048),
            num_hidden_layers=layers,
            attention=_attention(keys, layer_types),
            rms_norm_eps=keys.optional("rms_norm_eps", float, 1e-5),
            sliding_window=_window(keys),
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            attention_value_scale=_value_scale(keys),
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=keys.optional("norm_topk_prob", bool, True),
            routed_scaling_factor=keys.optional("routed_scaling_factor", float, 1.0),
            n_group=n_group,
            topk_group=topk_group,
            attention_bias=keys.optional("attention_bias", bool, False),
            **keys.causal_lm_fields(max_position=131072, bos_token_id=1),
        )


def _types(keys: ConfigKeys, key: str, allowed: tuple[str, ...], default: list[str]) -> tuple[str, ...]:
    types = keys.cfg.get(key)
    types = default if types is None else types
    if not isinstance(types, list) or len(types) != len(default):
        raise keys.error(f"{key!r} must list one type per layer ({len(default)}), got {types!r}")
    for t in types:
        if t not in allowed:
            raise keys.error(f"{key!r} entry {t!r} is not supported ({', '.join(allowed)})")
    return tuple(types)


# transformers' defaults, the MiMo-V2-Flash release's thetas
_DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
}


def _rope(keys: ConfigKeys, kind: str, head_dim: int) -> tuple[RopeScaling, int]:
    """``rope_parameters[kind]`` -> (its RoPE, rotary dims); rotary dims ``int(head_dim * partial_rotary_factor)``
    (transformers' rounding: 192 x 0.334 -> 64)."""
    if keys.cfg.get("rope_scaling"):
        raise keys.error("'rope_scaling' is not supported (only default RoPE per layer type)")
    if not keys.cfg.get("rope_parameters"):
        keys = ConfigKeys({**keys.cfg, "rope_parameters": _DEFAULT_ROPE}, keys.where)
    rope = keys.rope(supported=("default",), section=kind)
    return rope, keys.rotary_dim(head_dim, default_factor=0.334, section=kind)


def _attention(keys: ConfigKeys, layer_types: tuple[str, ...]) -> dict[str, AttentionShape]:
    """transformers' shapes: every layer has the same q heads and dims; sliding layers have twice the KV
    heads (hard-coded there) and a sink per query head, full layers none."""
    heads = keys.positive("num_attention_heads")
    kv_heads = keys.positive("num_key_value_heads")
    head_dim, v_head_dim = keys.positive("head_dim", 192), keys.positive("v_head_dim", 128)
    out: dict[str, AttentionShape] = {}
    for kind in sorted(set(layer_types)):
        sliding = kind == "sliding_attention"
        kv = 2 * kv_heads if sliding else kv_heads
        if heads % kv:
            raise keys.error(
                f"'num_attention_heads'={heads} is not a multiple of the {kind} layers' "
                f"{kv} KV heads ('num_key_value_heads'={kv_heads}{', doubled' if sliding else ''})"
            )
        rope, rotary = _rope(keys, kind, head_dim)
        out[kind] = AttentionShape(
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            sinks=sliding,
            rope=rope,
            rotary_dim=rotary,
        )
    return out


def _value_scale(keys: ConfigKeys) -> float:
    """transformers: 0.707 when the key is absent, 1.0 when it is null."""
    if "attention_value_scale" not in keys.cfg:
        return 0.707
    return keys.optional("attention_value_scale", float, 1.0)


def _window(keys: ConfigKeys) -> int:
    """transformers' rule: ``sliding_window_size`` W (the release's key) means W previous tokens plus the
    query, ``W + 1`` keys; else ``sliding_window`` counts the keys, the query's own included."""
    if keys.cfg.get("sliding_window_size") is not None:
        window = keys.required("sliding_window_size", int) + 1
    else:
        window = keys.positive("sliding_window", 129)
    if window < 2:
        raise keys.error(f"'sliding_window'={window} must cover at least 2 tokens")
    return window
