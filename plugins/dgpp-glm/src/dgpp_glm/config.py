"""HF ``config.json`` of a ``glm4_moe`` checkpoint (GLM-4.5/4.6/4.7) -> a typed architecture config.

Values this family does not implement are refused by key name rather than guessed around: a RoPE
scaling we do not compute, an activation other than SiLU, a routing shape the router cannot honour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dgpp.plugin_api import COMPUTE_DTYPES, ConfigError

# Keys that change what the model computes and that this family does not implement when set.
_MUST_BE_UNSET = ("rope_scaling", "sliding_window", "layer_types", "mlp_layer_types")


@dataclass(frozen=True)
class Glm4MoeArchConfig:
    """Architecture of a GLM-4.x MoE model (``Glm4MoeForCausalLM``): GQA with q/k/v biases, per-head q/k
    RMSNorm, half-split partial RoPE, ``first_k_dense_replace`` dense layers then sigmoid-routed MoE layers
    with a correction bias, group-limited top-k, routed scaling and shared experts; optional MTP layers
    stored after the last decoder layer (``model.layers.{num_hidden_layers + i}``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    use_qk_norm: bool
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    first_k_dense_replace: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_mtp_layers: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quant_method: str | None = None  # e.g. 'modelopt' (NVFP4) for nvidia/GLM-4.7-NVFP4

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layers below ``first_k_dense_replace`` (and none past the stack) use the dense MLP."""
        return layer_idx >= self.first_k_dense_replace

    @property
    def mtp_layer_indices(self) -> tuple[int, ...]:
        """Checkpoint indices of the MTP layers (they follow the decoder stack)."""
        return tuple(self.num_hidden_layers + i for i in range(self.num_mtp_layers))


def _req(cfg: dict[str, Any], key: str, kind: type) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"glm4_moe config.json: required key {key!r} is missing")
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(f"glm4_moe config.json: {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _opt(cfg: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    return default if cfg.get(key) is None else _req(cfg, key, kind)


def _positive(name: str, value: int) -> int:
    if value <= 0:
        raise ConfigError(f"glm4_moe config.json: {name!r} must be positive, got {value}")
    return value


def _rope(cfg: dict[str, Any], head_dim: int) -> tuple[float, int]:
    """(theta, rotary_dim) from either the transformers-5 ``rope_parameters`` or the flat release keys."""
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"glm4_moe config.json: rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"glm4_moe config.json: 'rope_theta' must be a positive number, got {theta!r}")
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"glm4_moe config.json: 'partial_rotary_factor' must be in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2:
        raise ConfigError(
            f"glm4_moe config.json: 'partial_rotary_factor'={factor} gives an odd rotary dim {rotary_dim} of head_dim {head_dim}"
        )
    return float(theta), rotary_dim


def _quant_method(cfg: dict[str, Any]) -> str | None:
    """The shipped weight format's method; dgpp.quant resolves it per module (and refuses unknown ones)."""
    from dgpp.plugin_api import QuantScheme

    scheme = QuantScheme.from_hf_config(cfg)
    return None if scheme is None else scheme.method


def _eos(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def parse_glm4_moe_config(cfg: dict[str, Any]) -> Glm4MoeArchConfig:
    """Validate ``cfg`` (config.json as a dict) and return the typed config; ConfigError names the key."""
    for key in _MUST_BE_UNSET:
        if cfg.get(key) not in (None, {}, []):
            raise ConfigError(f"glm4_moe config.json: {key!r}={cfg[key]!r} is not supported by dgpp-glm")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"glm4_moe config.json: 'hidden_act'={act!r} is not supported (only 'silu')")
    hidden = _positive("hidden_size", _req(cfg, "hidden_size", int))
    heads = _positive("num_attention_heads", _req(cfg, "num_attention_heads", int))
    kv_heads = _positive("num_key_value_heads", _req(cfg, "num_key_value_heads", int))
    if heads % kv_heads:
        raise ConfigError(f"glm4_moe config.json: 'num_attention_heads'={heads} is not a multiple of 'num_key_value_heads'={kv_heads}")
    head_dim = _positive("head_dim", _opt(cfg, "head_dim", int, hidden // heads))
    theta, rotary_dim = _rope(cfg, head_dim)
    layers = _positive("num_hidden_layers", _req(cfg, "num_hidden_layers", int))
    experts = _positive("n_routed_experts", _req(cfg, "n_routed_experts", int))
    top_k = _positive("num_experts_per_tok", _req(cfg, "num_experts_per_tok", int))
    n_group = _positive("n_group", _opt(cfg, "n_group", int, 1))
    topk_group = _positive("topk_group", _opt(cfg, "topk_group", int, 1))
    if experts % n_group:
        raise ConfigError(f"glm4_moe config.json: 'n_routed_experts'={experts} is not a multiple of 'n_group'={n_group}")
    if topk_group > n_group:
        raise ConfigError(f"glm4_moe config.json: 'topk_group'={topk_group} exceeds 'n_group'={n_group}")
    per_group = experts // n_group
    if n_group > 1 and per_group < 2:  # a group is scored by the sum of its two best experts
        raise ConfigError(f"glm4_moe config.json: 'n_group'={n_group} leaves {per_group} expert per group (need >= 2)")
    if top_k > topk_group * per_group:
        raise ConfigError(
            f"glm4_moe config.json: 'num_experts_per_tok'={top_k} exceeds the {topk_group * per_group} experts "
            f"that 'topk_group'={topk_group} groups offer"
        )
    mtp = _opt(cfg, "num_nextn_predict_layers", int, 0)
    if mtp < 0:
        raise ConfigError(f"glm4_moe config.json: 'num_nextn_predict_layers'={mtp} must be >= 0")
    dtype_name = cfg.get("dtype", cfg.get("torch_dtype")) or "bfloat16"
    if dtype_name not in COMPUTE_DTYPES:
        raise ConfigError(f"glm4_moe config.json: 'torch_dtype'={dtype_name!r} is not supported ({', '.join(COMPUTE_DTYPES)})")
    first_dense = _opt(cfg, "first_k_dense_replace", int, 1)
    if first_dense < 0:
        raise ConfigError(f"glm4_moe config.json: 'first_k_dense_replace'={first_dense} must be >= 0")
    return Glm4MoeArchConfig(
        vocab_size=_positive("vocab_size", _req(cfg, "vocab_size", int)),
        hidden_size=hidden,
        intermediate_size=_positive("intermediate_size", _req(cfg, "intermediate_size", int)),
        moe_intermediate_size=_positive("moe_intermediate_size", _req(cfg, "moe_intermediate_size", int)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_opt(cfg, "rms_norm_eps", float, 1e-5),
        attention_bias=_opt(cfg, "attention_bias", bool, False),
        use_qk_norm=_opt(cfg, "use_qk_norm", bool, False),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        max_position_embeddings=_positive("max_position_embeddings", _opt(cfg, "max_position_embeddings", int, 131072)),
        first_k_dense_replace=first_dense,
        n_routed_experts=experts,
        n_shared_experts=_opt(cfg, "n_shared_experts", int, 1),
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=_opt(cfg, "norm_topk_prob", bool, True),
        routed_scaling_factor=_opt(cfg, "routed_scaling_factor", float, 1.0),
        num_mtp_layers=mtp,
        tie_word_embeddings=_opt(cfg, "tie_word_embeddings", bool, False),
        dtype=COMPUTE_DTYPES[dtype_name],
        eos_token_ids=_eos(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        quant_method=_quant_method(cfg),
    )
