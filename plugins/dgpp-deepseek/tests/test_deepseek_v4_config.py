"""``deepseek_v4`` config.json parsing: the release's legacy keys fold in as transformers folds them, and values
the family does not compute are refused naming the key."""

from __future__ import annotations

import pytest

from dgpp.errors import ConfigError
from dgpp_deepseek.config import CSA, HCA, SLIDING, DeepseekV4ArchConfig
from dgpp_deepseek.testing import tiny_deepseek_v4_config


def test_release_keys_fold_in() -> None:
    """The release's config: per-layer ``compress_ratios`` (one more entry than layers: the MTP block),
    ``num_hash_layers``, ``qk_rope_head_dim`` and flat YaRN ``rope_scaling`` for the compressed layers."""
    raw = tiny_deepseek_v4_config(
        num_hidden_layers=5,
        compress_ratios=[0, 0, 4, 128, 4, 0],
        num_hash_layers=3,
        qk_rope_head_dim=8,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    )
    for key in ("layer_types", "mlp_layer_types", "rope_parameters"):
        raw.pop(key)
    cfg = DeepseekV4ArchConfig.from_hf_config(raw)
    assert cfg.layer_types == (SLIDING, SLIDING, CSA, HCA, CSA)
    assert cfg.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 2
    assert (cfg.rope_head_dim, cfg.rope_theta, cfg.compress_rope_theta) == (8, 10000.0, 160000.0)
    assert cfg.compress_yarn.factor == 16 and cfg.compress_yarn.magnitude() == 1.0  # cos/sin unscaled
    assert [cfg.ratio(i) for i in range(5)] == [0, 0, 4, 8, 4]  # the tiny config's HCA rate


def test_nested_rope_parameters_as_transformers_saves_them() -> None:
    raw = tiny_deepseek_v4_config(
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 5000.0},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 80000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.0,
            },
        }
    )
    cfg = DeepseekV4ArchConfig.from_hf_config(raw)
    assert (cfg.rope_theta, cfg.compress_rope_theta, cfg.compress_yarn.factor) == (5000.0, 80000.0, 2.0)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"layer_types": ["sliding_attention", "full_attention", CSA, CSA]}, "layer_types"),
        ({"compress_ratios": [0, 2, 4, 4], "layer_types": None}, "compress_ratios"),
        ({"mlp_layer_types": ["moe", "dense", "moe", "moe"]}, "mlp_layer_types"),
        ({"num_attention_heads": 5}, "o_groups"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
        ({"sliding_window": 1}, "sliding_window"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"hidden_size": None}, "hidden_size"),
        ({"index_topk": True}, "index_topk"),
        ({"compress_rates": {CSA: 4, HCA: 0}}, "compress_rates"),
        ({"torch_dtype": "int8", "dtype": None}, "torch_dtype"),
    ],
)
def test_unsupported_values_are_refused_by_name(overrides, key) -> None:
    with pytest.raises(ConfigError, match=key):
        DeepseekV4ArchConfig.from_hf_config(tiny_deepseek_v4_config(**overrides))
