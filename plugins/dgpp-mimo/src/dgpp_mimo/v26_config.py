"""MiMo-V2.6 (``mimo_v2`` / ``MiMoV2ForCausalLM``) config.json -> the canonical ``mimo_v2_flash`` config.

The V2.6 release computes what transformers' ``mimo_v2_flash`` computes, under other key names: the layer
pattern is ``hybrid_layer_pattern`` (1 = sliding window), the MLP pattern ``moe_layer_freq`` (0 = dense), the
norm epsilon ``layernorm_epsilon``, one RoPE theta per layer type (``rope_theta`` / ``swa_rope_theta``), and
the sliding layers' heads are spelled out (``swa_*``). ``canonical_config`` rewrites those keys into the
``mimo_v2_flash`` form the flash model is built from; any V2.6 value that model does not compute (full-layer
sinks, sliding heads other than twice the global KV heads, shared experts, ...) is one ``ConfigError`` naming
the key.

The window. V2.6 ships ``sliding_window`` = ``sliding_window_size`` = 128, and its modeling code builds the
sliding mask from ``sliding_window`` with transformers' rule (a row at ``p`` sees ``p - 127 .. p``): 128 keys
including the current token. vLLM's MiMo attention (a 128 window, current token included) and the original
engine ([pos - 127, pos]) agree. transformers' ``mimo_v2_flash`` instead reads ``sliding_window_size`` as
"previous tokens plus the query" and attends 129 (SGLang's rule). The canonical config therefore carries the
window explicitly as ``sliding_window`` (keys including the current token) and never ``sliding_window_size``,
so nothing downstream can add the extra key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dgpp.plugin_api import ConfigError
from dgpp_mimo.config import MimoArchConfig

_WHERE = "mimo_v2 config.json"
SLIDING, FULL = "sliding_attention", "full_attention"
# keys copied as they are (same name and meaning in both configs), when present
_SHARED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "v_head_dim",
    "attention_value_scale",
    "n_routed_experts",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "hidden_act",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "attention_bias",
    "dtype",
    "torch_dtype",
    "num_nextn_predict_layers",
    "initializer_range",
)
LAYOUTS = ("fused_qkv", "split")


def _req(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"{_WHERE}: required key {key!r} is missing")
    return cfg[key]


def _int(cfg: dict[str, Any], key: str) -> int:
    value = _req(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{_WHERE}: {key!r} must be a positive integer, got {value!r}")
    return value


def _pattern(cfg: dict[str, Any], key: str, layers: int, names: tuple[str, str]) -> list[str]:
    """A per-layer 0/1 list -> the per-layer names (``names[0]`` for 0, ``names[1]`` for 1)."""
    value = cfg.get(key)
    if (
        not isinstance(value, list)
        or len(value) != layers
        or any(v not in (0, 1) or v is True or v is False for v in value)
    ):
        raise ConfigError(
            f"{_WHERE}: {key!r} must list 0 or 1 for each of the {layers} layers, got {value!r}"
        )
    return [names[v] for v in value]


def _same(cfg: dict[str, Any], key: str, want: Any, why: str) -> None:
    """``cfg[key]`` (when given) must equal ``want``: the flash model computes only that value."""
    if key in cfg and cfg[key] is not None and cfg[key] != want:
        raise ConfigError(f"{_WHERE}: {key!r} = {cfg[key]!r} is not supported ({why})")


def window_of(cfg: dict[str, Any]) -> int:
    """The sliding window in keys, the current token included (see the module docstring)."""
    window, size = cfg.get("sliding_window"), cfg.get("sliding_window_size")
    if window is not None and size is not None and window != size:
        raise ConfigError(
            f"{_WHERE}: 'sliding_window' = {window!r} and 'sliding_window_size' = {size!r} disagree; "
            "the release gives both the same value (keys seen, the current token included)"
        )
    value = window if window is not None else size
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ConfigError(f"{_WHERE}: 'sliding_window' must be an integer of at least 2, got {value!r}")
    return value


def projection_layout(cfg: dict[str, Any]) -> str:
    layout = cfg.get("attention_projection_layout", "fused_qkv")
    if layout not in LAYOUTS:
        raise ConfigError(
            f"{_WHERE}: 'attention_projection_layout' = {layout!r} is not supported "
            f"(one of {', '.join(LAYOUTS)})"
        )
    return layout


def _check_attention(cfg: dict[str, Any]) -> None:
    heads, kv = _int(cfg, "num_attention_heads"), _int(cfg, "num_key_value_heads")
    head_dim, v_dim = _int(cfg, "head_dim"), _int(cfg, "v_head_dim")
    # the flash model's sliding layers have the global layers' heads and dims with twice the KV heads
    _same(cfg, "swa_num_attention_heads", heads, "sliding layers must have num_attention_heads query heads")
    _same(cfg, "swa_num_key_value_heads", 2 * kv, "sliding layers must have 2 x num_key_value_heads KV heads")
    _same(cfg, "swa_head_dim", head_dim, "sliding layers must have the global head_dim")
    _same(cfg, "swa_v_head_dim", v_dim, "sliding layers must have the global v_head_dim")
    _same(cfg, "add_swa_attention_sink_bias", True, "sliding layers always carry a sink per head")
    _same(cfg, "add_full_attention_sink_bias", False, "global layers carry no sinks")
    _same(cfg, "attention_bias", False, "the fused qkv projection has no bias")
    _same(cfg, "rope_scaling", None, "plain RoPE only")
    _same(cfg, "hidden_act", "silu", "SwiGLU MLPs")


def _check_moe(cfg: dict[str, Any]) -> None:
    _same(cfg, "scoring_func", "sigmoid", "sigmoid routing only")
    _same(cfg, "topk_method", "noaux_tc", "top-k on sigmoid + correction bias only")
    if cfg.get("n_shared_experts") not in (None, 0):
        raise ConfigError(
            f"{_WHERE}: 'n_shared_experts' = {cfg['n_shared_experts']!r} is not supported "
            "(MiMo has no shared expert)"
        )


def canonical_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``mimo_v2_flash`` config the V2.6 ``cfg`` describes (see the module docstring)."""
    layers = _int(cfg, "num_hidden_layers")
    if cfg.get("hybrid_layer_pattern") is None and cfg.get("hybrid_block_size") is not None:
        raise ConfigError(f"{_WHERE}: 'hybrid_block_size' is not supported; give 'hybrid_layer_pattern'")
    layer_types = _pattern(cfg, "hybrid_layer_pattern", layers, (FULL, SLIDING))
    mlp_types = _pattern(cfg, "moe_layer_freq", layers, ("dense", "sparse"))
    _check_attention(cfg)
    if "sparse" in mlp_types:
        _check_moe(cfg)
    projection_layout(cfg)
    rotary = cfg.get("partial_rotary_factor", 1.0)
    out = {key: cfg[key] for key in _SHARED_KEYS if key in cfg}
    out.update(
        model_type="mimo_v2_flash",
        architectures=["MiMoV2FlashForCausalLM"],
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        rms_norm_eps=_req(cfg, "layernorm_epsilon"),
        rope_parameters={
            FULL: {
                "rope_type": "default",
                "rope_theta": float(_req(cfg, "rope_theta")),
                "partial_rotary_factor": rotary,
            },
            SLIDING: {
                "rope_type": "default",
                "rope_theta": float(_req(cfg, "swa_rope_theta")),
                "partial_rotary_factor": rotary,
            },
        },
        sliding_window=window_of(cfg),
    )
    return out


class MimoV26Config(MimoArchConfig):
    """A V2.6 config.json read as the flash config it describes (``canonical_config``)."""

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> MimoV26Config:
        return super().from_hf_config(canonical_config(dict(hf_config)))
