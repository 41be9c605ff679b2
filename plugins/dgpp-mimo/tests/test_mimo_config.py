"""mimo_v2_flash config.json parsing (the released shape and transformers' defaults, refusals by key name) and the
memory plan with real byte counts: paged KV for the full-attention layers only, a window ring per request for
each sliding layer (twice the KV heads, q/k 192 and v 128 wide), split over tensor-parallel ranks."""

from __future__ import annotations

import json

import pytest
import torch

from dgpp.config import parse_config
from dgpp.errors import ConfigError
from dgpp.family import LoadContext, World
from dgpp.plugins import build_manager
from dgpp.startup.memory_plan import plan_for
from dgpp_mimo.config import MimoArchConfig
from dgpp_mimo.testing import MIMO_V2_FLASH_RELEASE as MIMO

FULL_LAYERS = (0, 5, 11, 17, 23, 29, 35, 41, 47)


def test_release_config_parses_with_transformers_defaults():
    cfg = MimoArchConfig.from_hf_config(MIMO)
    assert tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention") == FULL_LAYERS
    assert cfg.mlp_layer_types == ("dense",) + ("sparse",) * 47
    assert cfg.sliding_window == 129  # sliding_window_size 128 previous tokens plus the query
    full, sliding = cfg.attention["full_attention"], cfg.attention["sliding_attention"]
    assert (full.num_heads, full.num_kv_heads, full.head_dim, full.v_head_dim) == (64, 4, 192, 128)
    assert (sliding.num_kv_heads, sliding.sinks, full.sinks) == (8, True, False)
    assert (full.rope_theta, sliding.rope_theta, full.rotary_dim, sliding.rotary_dim) == (5e6, 1e4, 64, 64)
    assert (
        cfg.attention_value_scale == 0.707
        and cfg.routed_scaling_factor == 1.0
        and cfg.dtype == torch.bfloat16
    )
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == ()


def test_transformers_value_rules():
    """A stated ``sliding_window`` counts keys; a null value scale is 1.0, an absent one 0.707."""
    base = {k: v for k, v in MIMO.items() if k not in ("sliding_window_size", "attention_value_scale")}
    assert MimoArchConfig.from_hf_config({**base, "sliding_window": 64}).sliding_window == 64
    assert (
        MimoArchConfig.from_hf_config(base).sliding_window == 129
        and MimoArchConfig.from_hf_config(base).attention_value_scale == 0.707
    )
    assert MimoArchConfig.from_hf_config({**base, "attention_value_scale": None}).attention_value_scale == 1.0


@pytest.mark.parametrize(
    "change, key",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                    "sliding_attention": {"rope_theta": 1e4},
                }
            },
            "rope_type",
        ),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.01},
                    "sliding_attention": {"rope_theta": 1e4},
                }
            },
            "partial_rotary_factor",
        ),
        ({"layer_types": ["full_attention"] * 47}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 48}, "layer_types"),
        ({"mlp_layer_types": ["moe"] * 48}, "mlp_layer_types"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        (
            {"num_key_value_heads": 64},
            "num_key_value_heads",
        ),  # doubled on sliding layers: 128 does not divide 64
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"n_group": 3}, "n_group"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"sliding_window_size": 0}, "sliding_window"),
        ({"head_dim": "192"}, "head_dim"),
    ],
)
def test_unsupported_values_are_refused_by_key(change, key):
    with pytest.raises(ConfigError, match=key):
        MimoArchConfig.from_hf_config({**MIMO, **change})


@pytest.mark.parametrize("world", [1, 2])
def test_memory_plan_counts_window_bounded_kv(tmp_path, world):
    (tmp_path / "config.json").write_text(json.dumps(MIMO))
    engine = parse_config({"model": str(tmp_path), "world_size": world}).engine
    ctx = LoadContext(tmp_path, MIMO, "mimo", "MiMoV2FlashForCausalLM", engine=engine, world=World(0, world))
    plan = plan_for(build_manager(), ctx)
    # 9 full layers x 4 kv heads x (192 + 128) x 2 B = 23,040 B per token: sliding layers take no pool blocks
    assert plan.kv_per_token == len(FULL_LAYERS) * 4 * (192 + 128) * 2 // world
    # 39 rings of 128 positions x 8 kv heads x (192 + 128) x 2 B = 24.4 MiB per request
    assert plan.state_per_request == (48 - len(FULL_LAYERS)) * 128 * 8 * (192 + 128) * 2 // world
    # 308.8 B parameters in BF16, the routers, their correction biases and the sinks in fp32; TP splits all but
    # the norms, routers and (replicated) embedding rows of each rank's vocabulary share
    assert (
        plan.weights == _release_weight_bytes()
        if world == 1
        else 0.49 < plan.weights / _release_weight_bytes() < 0.51
    )


def _release_weight_bytes() -> int:
    hidden, vocab, sliding = 4096, 152576, 48 - len(FULL_LAYERS)
    o_proj, q_proj = 64 * 128 * hidden, hidden * 64 * 192

    def attention(kv_heads: int) -> int:
        return q_proj + hidden * kv_heads * (192 + 128) + o_proj

    bf16 = (
        len(FULL_LAYERS) * attention(4)
        + sliding * attention(8)
        + 47 * 256 * 3 * 2048 * hidden
        + 3 * hidden * 16384
        + 2 * vocab * hidden
        + (2 * 48 + 1) * hidden
    )
    fp32 = 47 * (256 * hidden + 256) + sliding * 64
    return 2 * bf16 + 4 * fp32
