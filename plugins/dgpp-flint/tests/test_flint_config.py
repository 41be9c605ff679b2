"""flint config.json parsing (the released shape, refusals by key name), the one-rank deployment template, and
the memory plan with real byte counts: paged KV for the full-attention layers only, a window ring per request
for each sliding layer, experts at their packed per-projection sizes."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from dgpp.config import load_config
from dgpp.errors import ConfigError
from dgpp.family import LoadContext, World
from dgpp.plugins import build_manager
from dgpp.startup.memory_plan import plan_for
from dgpp.step.memory import GiB
from dgpp_flint.config import FlintArchConfig
from dgpp_flint.testing import FLINT_RELEASE as FLINT

TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "flint_fp8-nvfp4_w1.json"
FULL_LAYERS = (0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 48)


def test_release_config_parses_with_the_default_layer_types():
    cfg = FlintArchConfig.from_hf_config(FLINT)
    assert tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention") == FULL_LAYERS
    assert cfg.sliding_window == 513 and cfg.head_dim == 128 and cfg.dtype == torch.bfloat16
    assert [cfg.is_moe_layer(i) for i in (0, 1, 2, 48)] == [False, False, True, True]


@pytest.mark.parametrize(
    "change, key",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"layer_types": ["full_attention"] * 48}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 49}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_unsupported_values_are_refused_by_key(change, key):
    with pytest.raises(ConfigError, match=key):
        FlintArchConfig.from_hf_config({**FLINT, **change})


def test_template_validates_and_keeps_mtp_off():
    deploy = load_config(TEMPLATE)
    assert deploy.model == "HawkBearPig/flint-FP8-NVFP4" and deploy.world == 1
    assert not deploy.engine.mtp and deploy.engine.bf16_weights == "bf12"


def test_memory_plan_counts_window_bounded_kv_and_packed_experts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLINT))
    deploy = load_config(TEMPLATE)
    ctx = LoadContext(tmp_path, FLINT, "flint", "FlintForCausalLM", engine=deploy.engine, world=World(0, 1))
    plan = plan_for(build_manager(), ctx)
    assert (
        plan.kv_per_token == len(FULL_LAYERS) * 4 * 128 * 2 * 2
    )  # 28,672 B: sliding layers take no pool blocks
    assert (
        plan.state_per_request == (49 - len(FULL_LAYERS)) * 512 * 4 * 128 * 2 * 2
    )  # 35 rings of 512 positions
    assert plan.state_per_request == 35 << 20
    # kv_dtype fp8: 1 byte per K/V value plus an fp32 scale per K row and per V row, pool and rings alike
    ctx8 = LoadContext(
        tmp_path,
        FLINT,
        "flint",
        "FlintForCausalLM",
        engine=msgspec.structs.replace(deploy.engine, kv_dtype="fp8"),
        world=World(0, 1),
    )
    plan8 = plan_for(build_manager(), ctx8)
    assert plan8.kv_per_token == len(FULL_LAYERS) * 4 * (256 + 8) == 14_784
    assert plan8.state_per_request == 35 * 512 * 4 * (256 + 8) == 18_923_520
    # experts: 23 FP8 layers at ~1 B/weight, 22 NVFP4 at ~0.56, two mixed; the rest BF16 (projections as bf12)
    expert_weights = 256 * 3 * 512 * 2048
    fp8, nvfp4 = expert_weights * (1 + 4 / 128**2), expert_weights * (0.5 + 1 / 16)
    assert plan.weights > 23 * fp8 + 22 * nvfp4 + 2 * min(fp8, nvfp4)
    assert 25 * GiB < plan.weights < 32 * GiB
    assert plan.fits(139 * GiB)  # one H200
