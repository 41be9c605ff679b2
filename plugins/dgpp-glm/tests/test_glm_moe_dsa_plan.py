"""Full GLM-5.3 at release shapes: the config as shipped parses, and the w4 template's memory plan (built on
meta, nothing read) counts latent bytes per token and fits a GB10 node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dgpp.config import load_config
from dgpp.family import LoadContext, World
from dgpp.plugins import build_manager
from dgpp.startup.memory_plan import plan_for
from dgpp.step.memory import GiB
from dgpp_glm.glm5_config import GlmMoeDsaArchConfig
from dgpp_glm.testing_glm5 import GLM5_PACKED_QUANTIZATION

TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "glm-5.3_int4-int8_w4.json"


# full GLM-5.3 in transformers' key style, with the int4/int8 group-64 release quantization
GLM_5_3 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0},
    "max_position_embeddings": 1048576,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "eos_token_id": [154820, 154827, 154829],
    "rms_norm_eps": 1e-5,
    "quantization_config": {
        **GLM5_PACKED_QUANTIZATION,
        "ignore": [*GLM5_PACKED_QUANTIZATION["ignore"], r"re:model\.layers\.78\..*"],  # the BF16 MTP layer
    },
}


def test_release_config_parses():
    cfg = GlmMoeDsaArchConfig.from_hf_config(GLM_5_3)
    assert cfg.indexer_types.count("full") == 21 and cfg.rope_theta == 8e6
    assert cfg.mlp_layer_types.count("dense") == 3 and cfg.quant_method == "compressed-tensors"


def test_w4_plan_counts_latent_bytes_and_fits_a_node(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM_5_3))
    save_file({"lm_head.weight": torch.zeros(1)}, tmp_path / "model.safetensors")  # names only
    deploy = load_config(TEMPLATE)
    assert deploy.world == 4 and not deploy.engine.mtp
    ctx = LoadContext(
        tmp_path, GLM_5_3, "glm", "GlmMoeDsaForCausalLM", engine=deploy.engine, world=World(0, 4)
    )
    plan = plan_for(build_manager(), ctx)
    # BF16 latent (512) + rotated rope key (64) on all 78 layers, a 128-wide indexer key on the 21 full ones
    assert plan.kv_per_token == (78 * (512 + 64) + 21 * 128) * 2 == 95_232
    assert 90 * GiB < plan.weights < 105 * GiB  # the original engine's ~99 GiB/rank at w4
    assert plan.fits(121 * GiB)


@pytest.mark.parametrize(
    ("kv_dtype", "per_token"),
    [
        # e4m3 latent + fp32 scale beside the BF16 rope key; e4m3 index key + fp32 scale
        ("fp8", 78 * (512 + 4 + 64 * 2) + 21 * (128 + 4)),
        # the 288-byte fp4 row (256 code bytes, 32 block scales) + fp32 scale beside the BF16 rope key
        ("fp4", 78 * (288 + 4 + 64 * 2) + 21 * (128 + 4)),
    ],
)
def test_w4_plan_counts_quantized_latent_bytes(tmp_path, kv_dtype, per_token):
    """engine.kv_dtype fp8 / fp4 on the w4 template: 95,232 B/token/rank become 53,004 / 35,532."""
    import msgspec

    (tmp_path / "config.json").write_text(json.dumps(GLM_5_3))
    save_file({"lm_head.weight": torch.zeros(1)}, tmp_path / "model.safetensors")  # names only
    engine = msgspec.structs.replace(load_config(TEMPLATE).engine, kv_dtype=kv_dtype)
    ctx = LoadContext(tmp_path, GLM_5_3, "glm", "GlmMoeDsaForCausalLM", engine=engine, world=World(0, 4))
    plan = plan_for(build_manager(), ctx)
    assert plan.kv_per_token == per_token and per_token in (53_004, 35_532)
    assert plan.fits(121 * GiB) and engine.lossy_levers() == ["kv_dtype"]


def test_w4_plan_with_mtp_adds_the_block_and_its_latent_rows(tmp_path):
    """engine.mtp on: the BF16 MTP layer 78 (it ships an indexer) adds its weights and one more latent + index
    row per token."""
    import msgspec

    names = [
        "lm_head.weight",
        "model.layers.78.eh_proj.weight",
        "model.layers.78.self_attn.indexer.wk.weight",
    ]
    (tmp_path / "config.json").write_text(json.dumps(GLM_5_3))
    save_file({n: torch.zeros(1) for n in names}, tmp_path / "model.safetensors")  # names only
    engine = msgspec.structs.replace(load_config(TEMPLATE).engine, mtp=True)
    ctx = LoadContext(tmp_path, GLM_5_3, "glm", "GlmMoeDsaForCausalLM", engine=engine, world=World(0, 4))
    plan = plan_for(build_manager(), ctx)
    assert plan.kv_per_token == (79 * (512 + 64) + 22 * 128) * 2
    # the block at TP 4 in BF16: MLA + 256 experts of 2048 sliced 4 ways, eh_proj and the indexer replicated
    assert 3 * GiB < plan.drafter < 6 * GiB


def test_bench_geometry_keeps_the_release_layers_packed():
    """``glm-5.3-12l`` (dgpp/bench/models.py): the release's first 12 layers in the int4/int8 form, indexer on the
    layers the release's schedule places it, small enough for one H200 with room for K/V."""
    from dgpp.plugin_api import quantize_modules
    from dgpp.testing.bench_geometry import hf_config
    from dgpp_glm.glm5 import GlmMoeDsaForCausalLM
    from dgpp_glm.model import checkpoint_name

    raw = hf_config("glm-5.3-12l", torch.bfloat16)
    cfg = GlmMoeDsaArchConfig.from_hf_config(raw)
    assert [i for i, t in enumerate(cfg.indexer_types) if t == "full"] == [0, 1, 2, 6, 10]
    assert cfg.indexer_types == GlmMoeDsaArchConfig.from_hf_config(GLM_5_3).indexer_types[:12]
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(cfg, dtype=torch.bfloat16)
        quantize_modules(model, raw, rename=checkpoint_name)
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 50e9 < stored < 60e9, stored  # 9 MoE layers of ~5 GB packed, embedding and head in BF16
