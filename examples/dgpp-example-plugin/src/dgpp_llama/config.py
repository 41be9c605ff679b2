"""config.json of a ``LlamaForCausalLM`` (``model_type: llama``) -> ``LlamaConfig``.

Keys and defaults are the ones transformers' ``LlamaConfig`` reads. RoPE comes from ``rope_parameters``
(transformers >= 5) or from top-level ``rope_theta`` plus ``rope_scaling`` (older configs); the scaling
types served are ``default``, ``linear``, ``llama3`` and ``yarn``. Anything else, and any value of the
wrong type, is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dgpp.plugin_api import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope_theta: float
    rope_type: str
    rope: dict[str, Any] = field(default_factory=dict)  # the scaling keys of rope_type
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: torch.dtype = torch.float32


def _get(raw: dict[str, Any], key: str, kind: type, default: Any = None, where: str = "") -> Any:
    value = raw.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"config.json: required key {where}{key!r} is missing")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"config.json: {where}{key} = {value!r} must be {kind.__name__}")
    return value


def _ids(value: Any, key: str) -> tuple[int, ...]:
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"config.json: {key} = {value!r} must be an int or a list of ints")
    return tuple(values)


def _rope(raw: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    if isinstance(raw.get("rope_parameters"), dict):
        params, where = dict(raw["rope_parameters"]), "rope_parameters."
    else:
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ConfigError("config.json: rope_scaling must be an object or null")
        params, where = dict(scaling or {}), "rope_scaling."
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    type_key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_key, "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"config.json: {where}{type_key} = {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    theta = _get(params, "rope_theta", float, 10000.0, where)
    scaling: dict[str, Any] = {}
    if rope_type != "default":
        scaling["factor"] = _get(params, "factor", float, where=where)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            scaling[key] = _get(params, key, float, where=where)
        scaling["original_max_position"] = _get(params, "original_max_position_embeddings", int, where=where)
    if rope_type == "yarn":
        scaling["original_max_position"] = _get(
            params, "original_max_position_embeddings", int, raw.get("max_position_embeddings"), where
        )
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if params.get(key) is not None:
                scaling[key] = _get(params, key, float, where=where)
        scaling["truncate"] = _get(params, "truncate", bool, True, where)
    return theta, rope_type, scaling


def parse_config(raw: dict[str, Any]) -> LlamaConfig:
    hidden = _get(raw, "hidden_size", int)
    heads = _get(raw, "num_attention_heads", int)
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"config.json: hidden_act = {raw['hidden_act']!r} is not supported (supported: 'silu')"
        )
    if raw.get("pretraining_tp", 1) != 1:
        raise ConfigError(
            f"config.json: pretraining_tp = {raw['pretraining_tp']!r} is not supported (only 1)"
        )
    theta, rope_type, scaling = _rope(raw)
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ConfigError(f"config.json: dtype = {dtype_name!r} is not supported ({', '.join(_DTYPES)})")
    return LlamaConfig(
        vocab_size=_get(raw, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_get(raw, "intermediate_size", int),
        num_layers=_get(raw, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", int, heads),
        head_dim=_get(raw, "head_dim", int, hidden // heads),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        max_position=_get(raw, "max_position_embeddings", int, 2048),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, False),
        attention_bias=_get(raw, "attention_bias", bool, False),
        mlp_bias=_get(raw, "mlp_bias", bool, False),
        rope_theta=theta,
        rope_type=rope_type,
        rope=scaling,
        eos_token_ids=_ids(raw.get("eos_token_id"), "eos_token_id"),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        dtype=_DTYPES[dtype_name],
    )
