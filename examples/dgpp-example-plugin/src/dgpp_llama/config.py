"""config.json of a ``LlamaForCausalLM`` (``model_type: llama``) -> ``LlamaConfig``.

Keys and defaults are the ones transformers' ``LlamaConfig`` reads. RoPE comes from ``rope_parameters``
(transformers >= 5) or from top-level ``rope_theta`` plus ``rope_scaling`` (older configs); the scaling types
served are ``default``, ``linear``, ``llama3`` and ``yarn``. Anything else, and any value of the wrong type, is a
``ConfigError`` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dgpp.nn.rotary import RopeScaling
from dgpp.plugin_api import CausalLMFields, ConfigKeys

_WHERE = "llama config.json"


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(CausalLMFields):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    rope: RopeScaling

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> LlamaConfig:
        keys = ConfigKeys(dict(hf_config), _WHERE)
        keys.only("hidden_act", "silu")
        if keys.optional("pretraining_tp", int, 1) != 1:
            raise keys.error(f"'pretraining_tp'={hf_config['pretraining_tp']!r} is not supported (only 1)")
        hidden = keys.positive("hidden_size")
        heads = keys.positive("num_attention_heads")
        return cls(
            vocab_size=keys.positive("vocab_size"),
            hidden_size=hidden,
            intermediate_size=keys.positive("intermediate_size"),
            num_hidden_layers=keys.positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=keys.positive("num_key_value_heads", heads),
            head_dim=keys.positive("head_dim", hidden // heads),
            rms_norm_eps=keys.optional("rms_norm_eps", float, 1e-6),
            attention_bias=keys.optional("attention_bias", bool, False),
            mlp_bias=keys.optional("mlp_bias", bool, False),
            rope=keys.rope(),
            **keys.causal_lm_fields(max_position=2048),
        )
