"""glm4_moe config.json parsing (the real GLM-4.7 shape, refusals by key name) and the GLM-4.7 deployment template."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgpp.config import load_config
from dgpp.errors import ConfigError
from dgpp_glm.config import Glm4MoeArchConfig

TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "glm-4.7_nvfp4_w4.json"

# GLM-4.7 as released, in the flat key style of its config.json, with the NVFP4 release's quantization_config.
GLM_4_7 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "attention_bias": True,
    "use_qk_norm": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000,
    "partial_rotary_factor": 0.5,
    "rope_scaling": None,
    "max_position_embeddings": 202752,
    "first_k_dense_replace": 3,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": [151329, 151336, 151338],
    "pad_token_id": 151329,
    "quantization_config": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "model.layers.92*"],
    },
}


def test_real_glm_4_7_config_parses():
    cfg = Glm4MoeArchConfig.from_hf_config(GLM_4_7)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (128, 64, 1e6)
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 91)] == [False, False, True, True]
    assert cfg.mtp_layer_indices == (92,)
    assert cfg.quant_method == "modelopt" and cfg.eos_token_ids == (151329, 151336, 151338)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
        ({"partial_rotary_factor": 0.305}, "partial_rotary_factor"),
        ({"n_group": 3}, "n_group"),
        ({"n_group": 8, "topk_group": 9}, "topk_group"),
        ({"n_group": 160, "topk_group": 8}, "n_group"),
        ({"n_group": 8, "topk_group": 1, "num_experts_per_tok": 21}, "num_experts_per_tok"),
        ({"num_attention_heads": 100}, "num_key_value_heads"),
        ({"hidden_size": "5120"}, "hidden_size"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ],
)
def test_unsupported_values_are_refused_by_key(change, key):
    with pytest.raises(ConfigError, match=key):
        Glm4MoeArchConfig.from_hf_config({**GLM_4_7, **change})


def test_glm_4_7_template_validates_and_fits_the_architecture():
    deploy = load_config(TEMPLATE)
    assert deploy.model == "nvidia/GLM-4.7-NVFP4" and deploy.world == 4
    assert deploy.engine.mtp and deploy.engine.mtp_depth >= 1
    # 1 + depth verify rows per slot stay within the original engine's 32 batched rows for GLM-4.7
    assert deploy.engine.max_concurrency * (1 + deploy.engine.mtp_depth) <= 32
    cfg = Glm4MoeArchConfig.from_hf_config(GLM_4_7)
    # TP over heads and MLP intermediate dims: every split the template's world needs is exact
    for size in (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        cfg.moe_intermediate_size,
    ):
        assert size % deploy.world == 0


def test_memory_plan_of_glm_4_7_nvfp4_at_w4(tmp_path):
    """The plugin's plan for the real shapes (built on meta, nothing read): KV rows match the original
    engine's 95 KB/token/rank at w4 (92 layers + the MTP layer), weights near its ~57 GiB/rank."""
    import json

    import torch
    from safetensors.torch import save_file

    from dgpp.family import LoadContext, World
    from dgpp.plugins import build_manager
    from dgpp.startup.memory_plan import plan_for
    from dgpp.step.memory import GiB

    (tmp_path / "config.json").write_text(json.dumps(GLM_4_7))
    save_file(
        {"model.layers.92.eh_proj.weight": torch.zeros(1)}, tmp_path / "model.safetensors"
    )  # names only
    deploy = load_config(TEMPLATE)
    ctx = LoadContext(tmp_path, GLM_4_7, "glm", "Glm4MoeForCausalLM", engine=deploy.engine, world=World(0, 4))
    plan = plan_for(build_manager(), ctx)
    assert plan.kv_per_token == 93 * 2 * 128 * 2 * 2 == 95_232
    import msgspec

    fp8 = msgspec.structs.replace(deploy.engine, kv_dtype="fp8")
    ctx8 = LoadContext(tmp_path, GLM_4_7, "glm", "Glm4MoeForCausalLM", engine=fp8, world=World(0, 4))
    # kv_dtype fp8: 1 byte per K/V value plus an fp32 scale per K row and per V row
    assert plan_for(build_manager(), ctx8).kv_per_token == 93 * 2 * (128 + 128 + 8) == 49_104
    assert 45 * GiB < plan.weights < 60 * GiB
    assert 1 * GiB < plan.drafter < 3 * GiB  # one BF16 MoE block sliced over 4 ranks
    assert plan.fits(121 * GiB)  # a GB10 node's OS-visible memory
