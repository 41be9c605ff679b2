"""Qwen config.json parsing: all four types (and the multimodal wrapper), unsupported values by key."""

from __future__ import annotations

import copy

import pytest
import torch

from dgpp.errors import ConfigError
from dgpp_qwen.config import QwenConfig

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "sliding_window": None,
    "attention_bias": False,
    "eos_token_id": 151645,
    "bos_token_id": 151643,
}
QWEN3_MOE = {
    **QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
QWEN35_TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 8,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "eos_token_id": 248044,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}
QWEN35_WRAPPER = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": QWEN35_TEXT,
    "vision_config": {"model_type": "qwen3_5_vision"},
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
QWEN35_MOE_WRAPPER = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        **{k: v for k, v in QWEN35_TEXT.items() if k != "intermediate_size"},
        "model_type": "qwen3_5_moe_text",
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
    },
}


def test_qwen3_release_config():
    cfg = QwenConfig.from_hf_config(QWEN3)
    assert (cfg.model_type, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("qwen3", 16, 8, 128)
    assert cfg.rope.theta == 1e6 and cfg.rope.rotary_dim == 128 and cfg.rope.yarn is None
    assert cfg.tie_word_embeddings and cfg.dtype == torch.bfloat16 and cfg.moe is None
    assert cfg.eos_token_ids == (151645,) and cfg.bos_token_id == 151643
    assert cfg.weight_prefix == "model." and not cfg.hybrid


def test_qwen3_moe_config_sparse_layers():
    cfg = QwenConfig.from_hf_config({**QWEN3_MOE, "mlp_only_layers": [0, 3], "decoder_sparse_step": 2})
    assert cfg.moe.num_experts == 128 and cfg.moe.top_k == 8 and cfg.moe.norm_topk_prob
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_qwen3_5_wrapper_reads_text_config():
    cfg = QwenConfig.from_hf_config(QWEN35_WRAPPER)
    assert cfg.model_type == "qwen3_5_text" and cfg.architecture == "Qwen3_5ForConditionalGeneration"
    assert cfg.weight_prefix == "model.language_model."
    assert cfg.hybrid and cfg.rope.rotary_dim == 64 and cfg.rope.mrope_section == (11, 11, 10)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",
    )
    assert cfg.linear_attn.num_value_heads == 48 and cfg.dtype == torch.bfloat16


def test_qwen3_5_moe_wrapper_and_plain_text_types():
    cfg = QwenConfig.from_hf_config(QWEN35_MOE_WRAPPER)
    assert cfg.model_type == "qwen3_5_moe_text" and cfg.moe.shared_expert_intermediate_size == 1024
    assert cfg.moe.norm_topk_prob and all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    plain = QwenConfig.from_hf_config({**QWEN35_TEXT, "architectures": ["Qwen3_5ForCausalLM"]})
    assert plain.weight_prefix == "model." and plain.moe is None and plain.intermediate_size == 17408


def test_legacy_rope_scaling_yarn():
    cfg = QwenConfig.from_hf_config(
        {**QWEN3, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    )
    assert cfg.rope.yarn.factor == 4.0 and cfg.rope.yarn.original_max_position == 32768


def _with(base: dict, path: str, value) -> dict:
    out = copy.deepcopy(base)
    node = out
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[key]
    node[leaf] = value
    return out


@pytest.mark.parametrize(
    "base, path, value, key",
    [
        (QWEN3, "rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "rope_scaling.rope_type"),
        (QWEN3, "rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling.type"),
        (
            QWEN35_WRAPPER,
            "text_config.rope_parameters.rope_type",
            "llama3",
            "text_config.rope_parameters.rope_type",
        ),
        (QWEN3, "rope_scaling", {"rope_type": "yarn"}, "rope_scaling: required key 'factor'"),
        (QWEN3, "hidden_act", "gelu", "hidden_act"),
        (QWEN35_WRAPPER, "text_config.hidden_act", "relu", "text_config.hidden_act"),
        (QWEN3, "use_sliding_window", True, "use_sliding_window"),
        (QWEN3, "layer_types", ["sliding_attention"] * 28, "layer_types[0]"),
        (QWEN35_WRAPPER, "text_config.attention_bias", True, "text_config.attention_bias"),
        (QWEN35_WRAPPER, "text_config.attn_output_gate", False, "text_config.attn_output_gate"),
        (QWEN35_WRAPPER, "text_config.layer_types", ["mamba"] * 8, "text_config.layer_types[0]"),
        (QWEN3, "num_key_value_heads", 5, "num_attention_heads"),
        (QWEN3, "hidden_size", "big", "hidden_size"),
        (QWEN3_MOE, "num_experts_per_tok", 500, "num_experts_per_tok"),
        (QWEN3, "torch_dtype", "float8", "dtype"),
        (QWEN35_WRAPPER, "text_config", None, "text_config"),
    ],
)
def test_unsupported_values_are_rejected_by_key(base, path, value, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        QwenConfig.from_hf_config(_with(base, path, value))


def test_missing_required_key_is_named():
    broken = {k: v for k, v in QWEN3.items() if k != "num_hidden_layers"}
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        QwenConfig.from_hf_config(broken)
