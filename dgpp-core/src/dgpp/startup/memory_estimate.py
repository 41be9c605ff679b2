"""A generic memory plan from config.json and safetensors headers (no weight is read).

Used when a family's plugin offers no ``dgpp_memory_plan``: it estimates the model's bytes (a ``ModelMemory``),
and ``dgpp.step.memory.plan_memory`` sizes the deployment from them as for every family. The estimate's rules:
weights = the checkpoint's stored bytes divided evenly over the ranks (TP shards nearly everything;
a quantized checkpoint stores its linears packed, so these are ``dgpp.quant.packed_bytes``, not dequantized bytes);
the drafter = tensors of MTP layers (named ``mtp`` or indexed past ``num_hidden_layers``); KV per
token from the attention geometry (MLA latent rows when ``kv_lora_rank`` is set); state per request
from linear-attention geometry; activations per prefill row from the hidden and MLP widths.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dgpp.checkpoint.headers import tensor_bytes
from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError
from dgpp.step.cache_spec import QUANTIZED_LATENT, fp4_row_bytes
from dgpp.step.memory import MemoryPlan, ModelMemory, plan_memory, transformer_activation_bytes

_DTYPE_BITS = {
    "F64": 64,
    "F32": 32,
    "F16": 16,
    "BF16": 16,
    "I64": 64,
    "I32": 32,
    "I16": 16,
    "I8": 8,
    "U8": 8,
    "BOOL": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "U16": 16,
    "U32": 32,
    "U64": 64,
}
_NAME_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "bf16": 16, "fp8": 8, "fp4": 4}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MTP = re.compile(r"(?:^|\.)mtp(?:\.|_)")


def _text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    # multimodal wrappers keep the language model's geometry under text_config
    return hf_config.get("text_config") or hf_config


def _compute_bits(hf_config: dict[str, Any], engine: EngineConfig) -> int:
    name: str = engine.dtype
    if name == "auto":
        name = str(
            hf_config.get("dtype")
            or hf_config.get("torch_dtype")
            or _text_config(hf_config).get("dtype")
            or "bfloat16"
        )
    return _NAME_BITS.get(name, 16)


def _layer_kinds(cfg: dict[str, Any]) -> tuple[int, int]:
    """(attention layers with a KV cache, linear-attention layers with a state)."""
    n = int(cfg.get("num_hidden_layers", 0))
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and kinds:
        linear = sum(1 for k in kinds if "linear" in str(k))
        return len(kinds) - linear, linear
    interval = cfg.get("full_attention_interval")
    if interval:
        return n // int(interval), n - n // int(interval)
    return n, 0


def _kv_bits_per_token(cfg: dict[str, Any], kv_name: str, act_bits: int, world: int) -> int:
    """K/V bits per token on one rank under ``engine.kv_dtype`` ``kv_name``: fp8 rows each with an fp32 scale; fp4
    (MLA latents only) packed rows with an fp32 scale, the rope part in the compute dtype."""
    attn_layers, _ = _layer_kinds(cfg)
    kv_bits = act_bits if kv_name == "auto" else _NAME_BITS[kv_name]
    row_scaled = kv_name in QUANTIZED_LATENT
    if cfg.get("kv_lora_rank"):  # MLA: one latent row (+ rope part) per token, replicated over ranks
        latent, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim", 0))
        if not row_scaled:
            return attn_layers * (latent + rope) * kv_bits
        latent_bits = fp4_row_bytes(latent) * 8 if kv_name == "fp4" else latent * 8
        return attn_layers * (latent_bits + 32 + rope * act_bits)
    if kv_name == "fp4":
        raise ConfigError(
            "engine.kv_dtype: 'fp4' stores MLA latents; this checkpoint's attention caches grouped-query K/V "
            'rows; use "auto" or "fp8"'
        )
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = max(1, int(cfg.get("num_key_value_heads") or heads) // world)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
    v_dim = int(cfg.get("v_head_dim") or head_dim)
    scale_bits = 2 * 32 if row_scaled else 0  # one fp32 scale for the K row and one for the V row
    return attn_layers * kv_heads * ((head_dim + v_dim) * kv_bits + scale_bits)


def _state_bytes_per_request(cfg: dict[str, Any], act_bits: int, world: int) -> int:
    _, linear_layers = _layer_kinds(cfg)
    if not linear_layers:
        return 0
    v_heads = max(1, int(cfg.get("linear_num_value_heads", 0)) // world)
    k_heads = max(1, int(cfg.get("linear_num_key_heads", 0)) // world)
    k_dim, v_dim = int(cfg.get("linear_key_head_dim", 0)), int(cfg.get("linear_value_head_dim", 0))
    kernel = int(cfg.get("linear_conv_kernel_dim", 4))
    recurrent = v_heads * k_dim * v_dim * 4  # fp32 recurrent state
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * (kernel - 1) * act_bits // 8
    return linear_layers * (recurrent + conv)


def estimate_model_memory(
    checkpoint_dir: Path, hf_config: dict[str, Any], engine: EngineConfig, world_size: int = 1
) -> ModelMemory:
    """The generic per-rank model bytes of a checkpoint under the deployment's ``engine`` settings."""
    cfg = _text_config(hf_config)
    n_layers = int(cfg.get("num_hidden_layers", 0))
    weights = drafter = 0
    for name, size in tensor_bytes(Path(checkpoint_dir)).items():
        layer = _LAYER.search(name)
        if _MTP.search(name) or (layer and int(layer.group(1)) >= n_layers):
            drafter += size
        else:
            weights += size
    act_bits = _compute_bits(hf_config, engine)
    mlp = max(
        int(cfg.get("intermediate_size", 0)),
        int(cfg.get("moe_intermediate_size", 0)) * int(cfg.get("num_experts_per_tok", 0)),
    )
    return ModelMemory(
        weights=-(-weights // world_size),
        drafter=-(-drafter // world_size),
        kv_per_token=-(-_kv_bits_per_token(cfg, engine.kv_dtype, act_bits, world_size) // 8),
        state_per_request=_state_bytes_per_request(cfg, act_bits, world_size),
        # bits, not bytes, per element: sub-byte compute names (fp4) count exactly
        activations_per_token=transformer_activation_bytes(
            int(cfg.get("hidden_size", 0)), mlp, world_size, act_bits
        )
        // 8,
        vocab_size=int(cfg.get("vocab_size", 0)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        notes=(
            "generic estimate from config.json and safetensors headers (the family plugin offers no plan)",
        ),
    )


def estimate_memory_plan(
    checkpoint_dir: Path, hf_config: dict[str, Any], engine: EngineConfig, world_size: int = 1
) -> MemoryPlan:
    """The generic per-rank plan for a checkpoint under the deployment's ``engine`` settings."""
    return plan_memory(estimate_model_memory(checkpoint_dir, hf_config, engine, world_size), engine)
