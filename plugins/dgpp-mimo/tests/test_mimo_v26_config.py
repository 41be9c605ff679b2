"""MiMo-V2.6 (``mimo_v2``) config.json -> the canonical ``mimo_v2_flash`` config: the release shape, the window
(128 keys with the current token, never transformers' 129), and every refusal naming its key."""

from __future__ import annotations

import pytest
import transformers

from dgpp.errors import ConfigError
from dgpp_mimo.testing_v26 import MIMO_V26_RELEASE
from dgpp_mimo.v26_config import canonical_config, window_of

GLOBAL_LAYERS = (0, 5, 11, 17, 23, 29, 35, 41, 47)


def _v26(**changes):
    cfg = dict(MIMO_V26_RELEASE)
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v != "<drop>"}


def test_release_config_maps_onto_the_flash_keys():
    cfg = canonical_config(MIMO_V26_RELEASE)
    assert cfg["model_type"] == "mimo_v2_flash" and cfg["architectures"] == ["MiMoV2FlashForCausalLM"]
    assert tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention") == GLOBAL_LAYERS
    assert cfg["mlp_layer_types"] == ["dense"] + ["sparse"] * 47
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["num_key_value_heads"] == 4
    rope = cfg["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] == 1e7 and rope["sliding_attention"]["rope_theta"] == 1e4
    assert rope["full_attention"]["partial_rotary_factor"] == 0.334
    assert cfg["num_nextn_predict_layers"] == 3 and "quantization_config" not in cfg


def test_window_is_128_keys_with_the_current_token_not_transformers_129():
    cfg = canonical_config(MIMO_V26_RELEASE)
    assert cfg["sliding_window"] == 128 and "sliding_window_size" not in cfg
    # transformers reads the release's sliding_window_size as "previous tokens plus the query": one key more
    assert transformers.MiMoV2FlashConfig(sliding_window_size=128).sliding_window == 129
    # the canonical config keeps the release's count through transformers too
    assert transformers.MiMoV2FlashConfig(sliding_window=cfg["sliding_window"]).sliding_window == 128
    assert window_of({"sliding_window_size": 64}) == 64 and window_of({"sliding_window": 32}) == 32


@pytest.mark.parametrize(
    "change, key",
    [
        ({"sliding_window": 128, "sliding_window_size": 129}, "sliding_window_size"),
        ({"sliding_window": "<drop>", "sliding_window_size": "<drop>"}, "sliding_window"),
        ({"sliding_window": 1, "sliding_window_size": 1}, "sliding_window"),
        ({"hybrid_layer_pattern": [0, 1] * 23}, "hybrid_layer_pattern"),
        ({"hybrid_layer_pattern": [2] * 48}, "hybrid_layer_pattern"),
        ({"hybrid_layer_pattern": "<drop>", "hybrid_block_size": 6}, "hybrid_block_size"),
        ({"moe_layer_freq": 1}, "moe_layer_freq"),
        ({"layernorm_epsilon": "<drop>"}, "layernorm_epsilon"),
        ({"swa_rope_theta": "<drop>"}, "swa_rope_theta"),
        ({"swa_num_key_value_heads": 4}, "swa_num_key_value_heads"),
        ({"swa_num_attention_heads": 32}, "swa_num_attention_heads"),
        ({"swa_head_dim": 128}, "swa_head_dim"),
        ({"swa_v_head_dim": 192}, "swa_v_head_dim"),
        ({"add_full_attention_sink_bias": True}, "add_full_attention_sink_bias"),
        ({"add_swa_attention_sink_bias": False}, "add_swa_attention_sink_bias"),
        ({"attention_projection_layout": "fused_qkvo"}, "attention_projection_layout"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"n_shared_experts": 1}, "n_shared_experts"),
        ({"num_attention_heads": "<drop>"}, "num_attention_heads"),
    ],
)
def test_unsupported_values_are_refused_by_key(change, key):
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        canonical_config(_v26(**change))


def test_split_projection_layout_is_accepted():
    assert canonical_config(_v26(attention_projection_layout="split"))["layer_types"][0] == "full_attention"
