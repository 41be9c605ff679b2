"""glm_moe_dsa config.json parsing: the indexer schedule as transformers derives it, refusals by key name."""

from __future__ import annotations

import pytest

from dgpp.errors import ConfigError
from dgpp.nn.mla import mla_softmax_scale
from dgpp_glm.glm5_config import GlmMoeDsaArchConfig, indexer_types
from dgpp_glm.testing_glm5 import tiny_glm_moe_dsa_config


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"index_topk_freq": 4, "index_skip_topk_offset": 3},
        {"index_topk_freq": 2, "index_skip_topk_offset": 1},
        {"index_topk_freq": 3},
        {"index_topk_pattern": "FFSFSSFSSFSS"},
    ],
    ids=["default", "release", "tiny", "freq3", "pattern"],
)
def test_indexer_schedule_matches_transformers(keys):
    from transformers import GlmMoeDsaConfig

    theirs = GlmMoeDsaConfig(num_hidden_layers=12, **keys).indexer_types
    assert list(indexer_types(keys, 12)) == list(theirs)


def test_release_schedule_runs_21_indexers():
    kinds = indexer_types({"index_topk_freq": 4, "index_skip_topk_offset": 3}, 78)
    assert [i for i, k in enumerate(kinds) if k == "full"] == [0, 1, 2, *range(6, 78, 4)]
    assert kinds.count("full") == 21


def test_saved_config_round_trips(tmp_path):
    import json

    from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

    path = build_tiny_glm_moe_dsa(tmp_path)
    cfg = GlmMoeDsaArchConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    assert cfg.indexer_types == ("full", "shared", "full", "shared")
    assert cfg.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert (cfg.index_n_heads, cfg.index_topk, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (16, 8, 32, 8)


def test_yarn_softmax_scale_takes_mscale_squared():
    cfg = GlmMoeDsaArchConfig.from_hf_config(
        tiny_glm_moe_dsa_config(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            }
        )
    )
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import yarn_apply_mscale

    expected = yarn_apply_mscale({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}, 24**-0.5)
    assert mla_softmax_scale(24, cfg.yarn) == pytest.approx(expected, rel=1e-12)
    assert mla_softmax_scale(24, cfg.yarn) > 24**-0.5


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types"),
        ({"index_topk_pattern": "FS"}, "indexer_types"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type"),
    ],
)
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        GlmMoeDsaArchConfig.from_hf_config(tiny_glm_moe_dsa_config(**override))
