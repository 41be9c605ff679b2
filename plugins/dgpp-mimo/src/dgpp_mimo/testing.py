"""Tiny random ``mimo_v2_flash`` checkpoints, saved by transformers' ``MiMoV2FlashForCausalLM``.

The default shape has both attention kinds (transformers' default pattern at 6 layers: 0 and 5 full, 1-4
sliding, the sliding ones with twice the KV heads and sinks), q/k heads of 48 and v heads of 32 with RoPE on
the first 16 dims (``int(48 x 0.334)``) at a different theta per layer type, a dense layer 0 then MoE layers,
and a window of 8 tokens, so prompts longer than the window exercise it and the sinks.

``tiny_checkpoints`` and ``bench_geometries`` offer the builder (``mimo``) and the MiMo-V2.6 benchmark
geometries (``testing_v26``) to core.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dgpp.plugin_api import BenchGeometry, PackedRelease, TinyCheckpoint
from dgpp.testing.builders import save_one_file, spread_tensors

TINY_MIMO: dict[str, Any] = {
    "architectures": ["MiMoV2FlashForCausalLM"],
    "model_type": "mimo_v2_flash",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 48,
    "v_head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    # thetas far apart, so a layer rotated with the other type's theta misses
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.334},
    },
    "sliding_window": 8,
    "attention_value_scale": 0.707,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.08,
    "eos_token_id": 2,
    "bos_token_id": 1,
    "pad_token_id": 0,
}


def tiny_mimo_config(**overrides: Any) -> dict[str, Any]:
    cfg = dict(TINY_MIMO)
    cfg.update(overrides)
    return cfg


def _spread_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norms away from 1, sinks of order 1 and correction biases of the sigmoid scores' order (HF initializes
    them at 1, N(0, 0.08) and 0), so a loader that drops any of them, or attention that ignores the sinks,
    or a router that ignores the bias, changes the logits."""
    spread_tensors(model.named_parameters(), gen, {"norm.weight": (1.0, 0.2), ".sinks": (0.0, 1.5)})
    spread_tensors(model.named_buffers(), gen, {"e_score_correction_bias": (0.0, 0.1)})


def build_tiny_mimo(
    out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Write a random ``MiMoV2FlashForCausalLM`` checkpoint (config.json + model.safetensors) to ``out_dir``."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    out = Path(out_dir)
    cfg = tiny_mimo_config(**overrides)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = MiMoV2FlashForCausalLM(MiMoV2FlashConfig(**kwargs, dtype=str(dtype).removeprefix("torch.")))
    model = model.to(dtype).eval()
    _spread_weights(model, torch.Generator().manual_seed(seed + 1))
    return save_one_file(model, out, "mimo")


# MiMo-V2-Flash as transformers' MiMoV2FlashConfig defaults describe the release (transformers >= 5.24): the hub
# config's `sliding_window_size` 128 (129 keys, the query included) and null `routed_scaling_factor` (1.0).
MIMO_V2_FLASH_RELEASE: dict[str, Any] = {
    "architectures": ["MiMoV2FlashForCausalLM"],
    "model_type": "mimo_v2_flash",
    "vocab_size": 152576,
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 192,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "sliding_window_size": 128,
    "attention_value_scale": 0.707,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": None,
    "norm_topk_prob": True,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def tiny_checkpoints() -> list[TinyCheckpoint]:
    return [
        TinyCheckpoint("mimo", build_tiny_mimo, "MiMo-V2-Flash: sliding and global attention with sinks, MoE")
    ]


def bench_geometries() -> list[BenchGeometry]:
    from dgpp_mimo.testing_v26 import MIMO_V26_BENCH, MIMO_V26_LAYERS, TINY_MIMO_V26_BENCH
    from dgpp_mimo.v26_checkpoint import RELEASE_BF16

    release = PackedRelease(keep_dense=(RELEASE_BF16,))  # ``dgpp bench --quant``: o_proj stays BF16
    return [
        BenchGeometry(
            f"mimo-v2.6-flash-{MIMO_V26_LAYERS}l",
            MIMO_V26_BENCH,
            "MiMo-V2.6-Flash's per-layer shape",
            release=release,
        ),
        BenchGeometry("tiny-mimo-v2.6", TINY_MIMO_V26_BENCH, "its CPU smoke version", release=release),
    ]
