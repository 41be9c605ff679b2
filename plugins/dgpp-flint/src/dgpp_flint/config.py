"""HF ``config.json`` of a ``flint`` checkpoint -> a typed architecture config.

Flint (transformers' ``FlintConfig``): GQA with per-head q/k RMSNorm and a learned sink per query head on
every layer; ``layer_types`` picks full attention (no positional encoding at all) or sliding-window attention
(RoPE over the whole head) per layer; a dense SwiGLU MLP on ``mlp_only_layers``, elsewhere a sigmoid-routed
MoE (top-k on the sigmoid scores, renormalized, no bias) plus an ungated shared expert. Values this family
does not compute are refused by key name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dgpp.plugin_api import CausalLMFields, ConfigError, ConfigKeys

_LAYER_TYPES = ("full_attention", "sliding_attention")
_WHERE = "flint config.json"


@dataclass(frozen=True, kw_only=True)
class FlintArchConfig(CausalLMFields):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_only_layers: tuple[int, ...]
    decoder_sparse_step: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "sliding_attention"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: MoE unless listed in ``mlp_only_layers``, on every ``decoder_sparse_step``-th layer."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> FlintArchConfig:
        """Validate config.json (as a dict) and return the typed config; ConfigError names the key."""
        cfg = dict(hf_config)
        keys = ConfigKeys(cfg, _WHERE)
        keys.only("hidden_act", "silu")
        if cfg.get("attention_bias"):
            raise ConfigError(
                f"{_WHERE}: 'attention_bias'=true is not supported (Flint projections carry no bias)"
            )
        heads = keys.positive("num_attention_heads")
        kv_heads = keys.positive("num_key_value_heads")
        if heads % kv_heads:
            raise ConfigError(
                f"{_WHERE}: 'num_attention_heads'={heads} is not a multiple of 'num_key_value_heads'={kv_heads}"
            )
        layers = keys.positive("num_hidden_layers")
        layer_types = _layer_types(cfg, layers)
        window = keys.positive("sliding_window", 513)
        if window < 2 and "sliding_attention" in layer_types:
            raise ConfigError(f"{_WHERE}: 'sliding_window'={window} must cover at least 2 tokens")
        experts = keys.optional("num_experts", int, 0)
        top_k = keys.positive("num_experts_per_tok", 1)
        if experts and top_k > experts:
            raise ConfigError(f"{_WHERE}: 'num_experts_per_tok'={top_k} exceeds 'num_experts'={experts}")
        hidden = keys.positive("hidden_size")
        return cls(
            vocab_size=keys.positive("vocab_size"),
            hidden_size=hidden,
            intermediate_size=keys.positive("intermediate_size"),
            moe_intermediate_size=keys.positive("moe_intermediate_size", 512),
            shared_expert_intermediate_size=keys.optional("shared_expert_intermediate_size", int, 1024),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=keys.positive("head_dim", hidden // heads),
            rms_norm_eps=keys.optional("rms_norm_eps", float, 1e-6),
            rope_theta=keys.rope(supported=("default",)).theta,  # plain RoPE, on the sliding layers
            sliding_window=window,
            layer_types=layer_types,
            mlp_only_layers=_int_list(cfg, "mlp_only_layers", [0, 1]),
            decoder_sparse_step=keys.positive("decoder_sparse_step", 1),
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=keys.optional("norm_topk_prob", bool, True),
            **keys.causal_lm_fields(max_position=262144),
        )


def _layer_types(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """The stated ``layer_types``, else transformers' default: full attention on layers 0, 1, every
    ``i % 4 == 1`` and the last, sliding window elsewhere."""
    types = cfg.get("layer_types")
    if types is None:
        return tuple(
            "full_attention" if i < 2 or i % 4 == 1 or i == layers - 1 else "sliding_attention"
            for i in range(layers)
        )
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError(f"{_WHERE}: 'layer_types' must list one type per layer ({layers}), got {types!r}")
    for t in types:
        if t not in _LAYER_TYPES:
            raise ConfigError(
                f"{_WHERE}: 'layer_types' entry {t!r} is not supported ({', '.join(_LAYER_TYPES)})"
            )
    return tuple(types)


def _int_list(cfg: dict[str, Any], key: str, default: list[int]) -> tuple[int, ...]:
    value = cfg.get(key)
    value = default if value is None else value
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"{_WHERE}: {key!r} must be a list of layer indices, got {value!r}")
    return tuple(value)
