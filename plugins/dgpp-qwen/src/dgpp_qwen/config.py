"""HF config.json -> typed Qwen architecture config, for qwen3, qwen3_moe, qwen3_5(_text) and
qwen3_5_moe(_text), including the ``Qwen3_5*ForConditionalGeneration`` wrapper whose text part is
under ``text_config``. Values this engine cannot run are rejected with a ``ConfigError`` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dgpp.nn.rotary import RopeScaling, YarnScaling
from dgpp.plugin_api import COMPUTE_DTYPES, ConfigKeys

DENSE_TYPES = ("qwen3",)
MOE_TYPES = ("qwen3_moe",)
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
WRAPPER_TYPES = ("qwen3_5", "qwen3_5_moe")  # multimodal wrappers: the text model is under text_config
LAYER_KINDS = ("full_attention", "linear_attention")
MTP_PREFIX = "mtp."  # the checkpoint stores a model's MTP layer under this prefix
# head_dim when config.json leaves it out (the HF classes' defaults)
_WHERE = "config.json"
_DEFAULT_HEAD_DIM = {"qwen3": 128, "qwen3_5_text": 256, "qwen3_5_moe_text": 256}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings: ``scaling`` as ``ConfigKeys.rope`` reads it (default or YaRN); ``rotary_dim`` of each head
    rotates (rotate-half); the mRoPE sections are kept for validation but collapse to 1-D for text."""

    scaling: RopeScaling
    rotary_dim: int
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    @property
    def theta(self) -> float:
        return self.scaling.theta

    @property
    def yarn(self) -> YarnScaling | None:
        return self.scaling.yarn


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (softmax top-k) and an optional sigmoid-gated shared expert (Qwen3.5-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class LinearAttnConfig:
    """Gated DeltaNet sizes of the hybrid (qwen3_5) layers."""

    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int


@dataclass(frozen=True)
class QwenConfig:
    """One Qwen text model's architecture. ``model_type`` is the text type (``qwen3_5_text`` for a
    wrapped ``qwen3_5``); ``weight_prefix`` is where the text model's tensors live in the checkpoint."""

    model_type: str
    architecture: str
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
    rope: RopeConfig
    layer_types: tuple[str, ...]
    moe: MoEConfig | None
    linear_attn: LinearAttnConfig | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    weight_prefix: str = "model."

    @property
    def hybrid(self) -> bool:
        """Qwen3.5 types: Gated DeltaNet layers with per-request state, gated attention, (1+w) norms."""
        return self.model_type in HYBRID_TYPES

    def is_moe_layer(self, layer: int) -> bool:
        moe = self.moe
        if moe is None or layer in moe.mlp_only_layers:
            return False
        return (layer + 1) % moe.decoder_sparse_step == 0

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> QwenConfig:
        """Validate config.json (as a dict) and return the typed config; ConfigError names the key."""
        hf_config = dict(hf_config)
        top = ConfigKeys(hf_config, _WHERE)
        model_type = top.required("model_type", str)
        archs = hf_config.get("architectures") or []
        architecture = archs[0] if archs else model_type
        keys, prefix = top, "model."
        if model_type in WRAPPER_TYPES:
            text = hf_config.get("text_config")
            if not isinstance(text, dict):
                raise top.error(f"{model_type} needs a 'text_config' object")
            keys, prefix = ConfigKeys(text, _WHERE, prefix="text_config."), "model.language_model."
            model_type = f"{model_type}_text"
        if model_type not in (*DENSE_TYPES, *MOE_TYPES, *HYBRID_TYPES):
            raise top.error(f"model_type = {model_type!r} is not a Qwen type this plugin parses")
        act = keys.optional("hidden_act", str, "silu")
        if act != "silu":
            raise keys.error(f"{keys.name('hidden_act')} = {act!r} is not supported (only 'silu')")
        attention_bias = keys.optional("attention_bias", bool, False)
        if attention_bias and model_type in HYBRID_TYPES:
            raise keys.error(f"{keys.name('attention_bias')} = true is not supported for {model_type}")
        # Qwen3.5 full attention always carries the [q|gate] output gate; a release without it is another model
        if model_type in HYBRID_TYPES and not keys.optional("attn_output_gate", bool, True):
            raise keys.error(f"{keys.name('attn_output_gate')} = false is not supported for {model_type}")
        hidden = keys.positive("hidden_size")
        heads = keys.positive("num_attention_heads")
        kv_heads = keys.positive("num_key_value_heads", heads)
        if heads % kv_heads:
            raise keys.error(
                f"{keys.name('num_attention_heads')} = {heads} is not a multiple of num_key_value_heads = {kv_heads}"
            )
        head_dim = keys.positive("head_dim", _DEFAULT_HEAD_DIM.get(model_type, hidden // heads))
        num_layers = keys.positive("num_hidden_layers")
        max_position = keys.positive("max_position_embeddings", 32768)
        dtype_name = (
            top.optional("dtype", str, None)
            or top.optional("torch_dtype", str, None)
            or keys.optional("dtype", str, None)
            or "float32"
        )
        if dtype_name not in COMPUTE_DTYPES:
            raise top.error(
                f"dtype = {dtype_name!r} is not supported (supported: {', '.join(COMPUTE_DTYPES)})"
            )
        tie = top.optional("tie_word_embeddings", bool, keys.optional("tie_word_embeddings", bool, False))
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=keys.positive("vocab_size"),
            hidden_size=hidden,
            # qwen3_5_moe_text has no dense MLP layers, hence no intermediate_size
            intermediate_size=0 if model_type == "qwen3_5_moe_text" else keys.positive("intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=keys.optional("rms_norm_eps", float, 1e-6),
            max_position=max_position,
            tie_word_embeddings=tie,
            attention_bias=attention_bias,
            rope=_parse_rope(keys, head_dim, 0.25 if model_type in HYBRID_TYPES else 1.0, max_position),
            layer_types=_parse_layer_types(keys, model_type, num_layers),
            moe=_parse_moe(keys, model_type),
            linear_attn=_parse_linear_attn(keys, model_type),
            eos_token_ids=_token_ids(keys, "eos_token_id") or _token_ids(top, "eos_token_id"),
            bos_token_id=keys.optional("bos_token_id", int, top.optional("bos_token_id", int, None)),
            dtype=COMPUTE_DTYPES[dtype_name],
            weight_prefix=prefix,
        )


def _token_ids(keys: ConfigKeys, key: str) -> tuple[int, ...]:
    value = keys.cfg.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise keys.error(f"{keys.name(key)} = {value!r} must be an int or a list of ints")
    return tuple(values)


def _parse_rope(keys: ConfigKeys, head_dim: int, default_partial: float, max_position: int) -> RopeConfig:
    # a YaRN block without original_max_position_embeddings takes the parsed (defaulted) max position
    rk = ConfigKeys({**keys.cfg, "max_position_embeddings": max_position}, keys.where, keys.prefix)
    rope = rk.rope(supported=("default", "yarn"))
    if rope.yarn is not None and rope.factor < 1:
        raise rk.error(f"{rk.name('factor')} = {rope.factor} must be >= 1")
    rotary_dim = rk.rotary_dim(head_dim, default_factor=default_partial)
    nested = isinstance(keys.cfg.get("rope_parameters"), dict)
    params = keys.cfg["rope_parameters"] if nested else keys.cfg.get("rope_scaling") or {}
    section = params.get("mrope_section")
    if section is not None:
        if not isinstance(section, list) or 2 * sum(section) != rotary_dim:
            raise rk.error(
                f"{rk.name(('rope_parameters' if nested else 'rope_scaling') + '.mrope_section')} = {section!r} must sum to rotary_dim/2 = {rotary_dim // 2}"
            )
        section = tuple(section)
    return RopeConfig(rope, rotary_dim, section, bool(params.get("mrope_interleaved", False)))


def _parse_layer_types(keys: ConfigKeys, model_type: str, num_layers: int) -> tuple[str, ...]:
    if keys.optional("use_sliding_window", bool, False):
        raise keys.error(
            f"{keys.name('use_sliding_window')} = true is not supported (sliding-window attention)"
        )
    types = keys.optional("layer_types", list, None)
    if types is None:
        if model_type not in HYBRID_TYPES:
            return ("full_attention",) * num_layers
        interval = keys.positive("full_attention_interval", 4)
        return tuple(
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        )
    if len(types) != num_layers:
        raise keys.error(f"{keys.name('layer_types')} has {len(types)} entries for {num_layers} layers")
    allowed = LAYER_KINDS if model_type in HYBRID_TYPES else ("full_attention",)
    for i, kind in enumerate(types):
        if kind not in allowed:
            raise keys.error(
                f"{keys.name(f'layer_types[{i}]')} = {kind!r} is not supported (supported: {', '.join(allowed)})"
            )
    return tuple(types)


def _parse_moe(keys: ConfigKeys, model_type: str) -> MoEConfig | None:
    if model_type not in ("qwen3_moe", "qwen3_5_moe_text"):
        return None
    expert_key = "num_experts" if "num_experts" in keys.cfg else "num_local_experts"
    num_experts = keys.positive(expert_key)
    top_k = keys.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise keys.error(f"{keys.name('num_experts_per_tok')} = {top_k} exceeds num_experts {num_experts}")
    hybrid = model_type == "qwen3_5_moe_text"
    only = keys.optional("mlp_only_layers", list, [])
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=keys.positive("moe_intermediate_size"),
        norm_topk_prob=True if hybrid else keys.optional("norm_topk_prob", bool, False),
        decoder_sparse_step=1 if hybrid else keys.positive("decoder_sparse_step", 1),
        mlp_only_layers=tuple(only),
        shared_expert_intermediate_size=keys.positive("shared_expert_intermediate_size") if hybrid else 0,
    )


def _parse_linear_attn(keys: ConfigKeys, model_type: str) -> LinearAttnConfig | None:
    if model_type not in HYBRID_TYPES:
        return None
    return LinearAttnConfig(
        conv_kernel=keys.positive("linear_conv_kernel_dim", 4),
        key_head_dim=keys.positive("linear_key_head_dim", 128),
        value_head_dim=keys.positive("linear_value_head_dim", 128),
        num_key_heads=keys.positive("linear_num_key_heads", 16),
        num_value_heads=keys.positive("linear_num_value_heads", 32),
    )
