"""DeepSeek-V4-Flash at release shapes: the config as shipped parses, and the w4 / w2 templates' memory plans
(built on meta in the release's formats, nothing read) count compressed entries per token, window rings per
request, and fit a 128 GB node (121 GiB usable) at the full 1M-token context."""

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
from dgpp_deepseek.config import DeepseekV4ArchConfig

# deepseek-ai/DeepSeek-V4-Flash-0731 : 43 layers (2 sliding, then CSA / HCA alternating;
# the 44th compress_ratios entry is the MTP block's), release quantization with MXFP4 experts
RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]
V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": RATIOS,
    "num_hash_layers": 3,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "expert_dtype": "fp4",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    },
}


def test_release_config_parses():
    cfg = DeepseekV4ArchConfig.from_hf_config(V4_FLASH)
    assert cfg.layer_types.count("compressed_sparse_attention") == 21
    assert cfg.layer_types.count("heavily_compressed_attention") == 20
    assert cfg.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)


@pytest.mark.parametrize("world,slots", [(4, 6), (2, 4)])
def test_template_plan_fits_a_node_at_1m_context(tmp_path, world, slots):
    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH))
    save_file({"head.weight": torch.zeros(1)}, tmp_path / "model.safetensors")  # names only
    root = Path(__file__).resolve().parents[3]
    deploy = load_config(root / "deploy" / f"deepseek-v4-flash_mxfp4-fp8_w{world}.json")
    assert deploy.world == world and deploy.engine.max_concurrency == slots and not deploy.engine.mtp
    assert deploy.engine.kv_capacity == 1 << 20
    ctx = LoadContext(
        tmp_path, V4_FLASH, "deepseek", "DeepseekV4ForCausalLM", engine=deploy.engine, world=World(0, world)
    )
    plan = plan_for(build_manager(), ctx)
    # per token, BF16: CSA a 512-wide entry and a 128-wide indexer key per 4 tokens, HCA a 512-wide entry per 128
    # tokens, whose pool holds one row per 16-token block (CompressedKV.bytes_per_token)
    assert plan.kv_per_token == 21 * (512 * 2 // 4 + 128 * 2 // 4) + 20 * (512 * 2 // 16)
    # routed experts are the bulk: 43 layers x 256 x 3 x 4096 x 2048 MXFP4 (0.5 B + one E8M0 per 32) / world
    experts = 43 * 256 * 3 * 4096 * 2048 * 17 // 32 // world
    assert experts < plan.weights < experts + 14 * GiB
    assert plan.fits(121 * GiB), plan.describe()


def test_fp8_kv_is_refused_by_the_plan_naming_the_cache_entries(tmp_path):
    """``engine.kv_dtype: fp8`` stores GQA / window / sink K/V only: ``dgpp check`` refuses it here as serve would."""
    import msgspec

    from dgpp.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH))
    save_file({"head.weight": torch.zeros(1)}, tmp_path / "model.safetensors")  # names only
    root = Path(__file__).resolve().parents[3]
    engine = msgspec.structs.replace(
        load_config(root / "deploy" / "deepseek-v4-flash_mxfp4-fp8_w4.json").engine, kv_dtype="fp8"
    )
    ctx = LoadContext(
        tmp_path, V4_FLASH, "deepseek", "DeepseekV4ForCausalLM", engine=engine, world=World(0, 4)
    )
    with pytest.raises(
        ConfigError, match=r"engine.kv_dtype: 'fp8'.*layers.0.attn \(WindowKV\).*compute dtype only"
    ):
        plan_for(build_manager(), ctx)
