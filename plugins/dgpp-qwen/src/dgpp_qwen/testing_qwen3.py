"""Tiny random Qwen3, Qwen3-MoE and Qwen3.5 hybrid checkpoints (text, and with a vision tower), built by
transformers' own classes (``dgpp.testing.builders.build_transformers_checkpoint``); ``build_qwen3_chat`` adds the
testing kit's byte-level chat tokenizer, its end-of-turn tokens the model's EOS (the CPU demo's
``dgpp-demo/qwen3-tiny``). ``GEOMETRIES``: the published Qwen geometries ``dgpp bench`` runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dgpp.testing.builders import TINY_TEXT, build_transformers_checkpoint

TINY_MOE: dict[str, Any] = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
TINY_LINEAR_ATTN: dict[str, Any] = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_hidden_layers": 4,
}
TINY_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
}
_HYBRID_MOE = {**TINY_LINEAR_ATTN, **TINY_MOE, "shared_expert_intermediate_size": 32}

# kind -> (transformers config class, model class, extra text keys, vision tower config for a ConditionalGeneration)
KINDS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any] | None]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, None),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**TINY_MOE, "norm_topk_prob": True}, None),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", TINY_LINEAR_ATTN, None),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _HYBRID_MOE, None),
    "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", TINY_LINEAR_ATTN, TINY_VISION),
    "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", _HYBRID_MOE, TINY_VISION),
}


def build_qwen3_chat(
    out_dir: str | Path, *, seed: int = 0, overrides: dict[str, Any] | None = None, **options: Any
) -> Path:
    """A tiny Qwen3 with the kit's byte-level chat tokenizer; ``<|im_end|>`` and ``<|endoftext|>`` are its EOS."""
    from tokenizers import Tokenizer

    from dgpp.testing.tokenizers import build_tiny_tokenizer

    out = Path(out_dir)
    build_tiny_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    chat = {"eos_token_id": eos, "pad_token_id": eos[1], "bos_token_id": None}
    config_cls, model_cls, extra, vision = KINDS["qwen3"]
    return build_transformers_checkpoint(
        config_cls,
        model_cls,
        out,
        text={**extra, **chat, **(overrides or {})},
        vision=vision,
        seed=seed,
        **options,
    )


def _hybrid_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5's layout: every ``interval``-th layer full attention, the others Gated DeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


# Qwen3.5 rotary: theta 1e7 on the first quarter of each 256-wide head; mRoPE sections collapse to 1-D for text
_QWEN35_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
# shared by both Qwen3.5 geometries: GDN sizes, tokenizer, context
_QWEN35_COMMON = {
    "vocab_size": 248320,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attn_output_gate": True,
    "rope_parameters": _QWEN35_ROPE,
}
# Qwen3.5-122B-A10B has 48 layers (240 GB in bf16); the benchmark keeps its per-layer shape and runs 24
# (18 GDN + 6 full attention, 60 GB of experts... 123 GB in all), which leaves K/V and workspace room on a 141 GB H200
MOE_122B_LAYERS = 24
_TINY_QWEN35 = {
    **TINY_TEXT,
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "num_hidden_layers": 4,
    "layer_types": _hybrid_layer_types(4),
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}

# HF config.json fields of the geometries (values from the published configs of the models named)
GEOMETRIES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3.5-27B text_config: 64 layers = 48 GDN (16 k / 48 v heads x 128) + 16 gated full attention
    # (24 q / 4 kv heads x 256), SwiGLU 17408 after each, hidden 5120
    "qwen3.5-27b": {
        **_QWEN35_COMMON,
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "layer_types": _hybrid_layer_types(64),
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "linear_num_value_heads": 48,
    },
    # Qwen/Qwen3.5-122B-A10B text_config per layer: hidden 3072, 32 q / 2 kv heads x 256, GDN 16 k / 64 v heads
    # x 128, 256 experts top-8 of 1024 + a sigmoid-gated shared expert of 1024; 24 of 48 layers
    f"qwen3.5-122b-a10b-{MOE_122B_LAYERS}l": {
        **_QWEN35_COMMON,
        "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "hidden_size": 3072,
        "num_hidden_layers": MOE_122B_LAYERS,
        "layer_types": _hybrid_layer_types(MOE_122B_LAYERS),
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 64,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
    },
    "tiny": {**TINY_TEXT, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    # CPU smoke versions of the two hybrids (3 GDN layers + 1 full attention)
    "tiny-qwen3.5": _TINY_QWEN35,
    "tiny-qwen3.5-moe": {
        **{k: v for k, v in _TINY_QWEN35.items() if k != "intermediate_size"},
        "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
}
