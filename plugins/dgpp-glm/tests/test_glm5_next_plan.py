"""GLM-5.3-Flash at release geometry: the NVFP4-FP8 release's config parses, the memory plan (built on meta, nothing
read but tensor names) counts packed bytes, the KDA state per request and the latent + pooled index rows per token,
and the shipped template ``glm-5.3-flash_nvfp4-fp8_w4`` passes ``dgpp check`` on its world of four GB10 nodes."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from dgpp.cli import main
from dgpp.config import load_config
from dgpp.family import LoadContext, World
from dgpp.plugins import build_manager
from dgpp.startup.memory_plan import plan_for
from dgpp.step.memory import GiB
from dgpp_glm.glm5_next_config import Glm5NextArchConfig

TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "glm-5.3-flash_nvfp4-fp8_w4.json"
MODEL = "HawkBearPig/GLM-5.3-Flash-NVFP4-FP8"
LAYERS = 45
KINDS = ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(LAYERS)]
MOE = list(range(3, LAYERS))

# GLM-5.3-Flash's text_config as the release writes it (transformers' glm5_next keys and the keys the original
# engine's parser requires), and the NVFP4-FP8 release's quantization_config
TEXT = {
    "model_type": "glm5_next_text",
    "vocab_size": 154880,
    "hidden_size": 4096,
    "num_hidden_layers": LAYERS,
    "layer_types": KINDS,
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * (LAYERS - 3),
    "indexer_types": ["full"] * LAYERS,
    "first_k_dense_replace": 3,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 288,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "swiglu_limit": 10.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_router_dtype": "float32",
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 256,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "mla_use_nope": True,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_kpool": 4,
    "index_kpool_compress": True,
    "index_kpool_always_select_tail": True,
    "linear_attn_config": {
        "kda_layers": [i for i, k in enumerate(KINDS) if k == "linear_attention"],
        "full_attn_layers": [i for i, k in enumerate(KINDS) if k != "linear_attention"],
        "num_heads": 64,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
    },
    "mhc": True,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "eos_token_id": [154820, 154827, 154829],
    "pad_token_id": 154820,
    "torch_dtype": "bfloat16",
}
FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.visual"],
}
GLM_5_3_FLASH = {
    "architectures": ["Glm5NextForConditionalGeneration"],
    "model_type": "glm5_next",
    "text_config": TEXT,
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "dgpp_mixed",
        "routed_experts": {"layers": MOE, "format": "nvfp4-pack-quantized", "num_bits": 4, "group_size": 16},
        "fp8": FP8,
        "mtp_layer": {"index": LAYERS, "source": "base"},
        "dsa_attention": {
            "layers": [i for i, k in enumerate(KINDS) if k != "linear_attention"],
            "source": "base",
        },
    },
}
# names only: the plan reads which MTP parts the checkpoint ships (its FP8 scales, its indexer)
MTP_NAMES = [
    "lm_head.weight",
    f"model.language_model.layers.{LAYERS}.eh_proj.weight",
    f"model.language_model.layers.{LAYERS}.self_attn.q_a_proj.weight_scale_inv",
    f"model.language_model.layers.{LAYERS}.self_attn.indexer.wk.weight",
]


def _checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(GLM_5_3_FLASH))
    save_file({n: torch.zeros(1) for n in MTP_NAMES}, root / "model.safetensors")
    return root


def test_release_config_parses():
    cfg = Glm5NextArchConfig.from_hf_config(GLM_5_3_FLASH)
    assert [cfg.is_linear(i) for i in range(LAYERS)].count(True) == 34 and cfg.index_kpool == 4
    assert cfg.mlp_layer_types.count("dense") == 3 and cfg.num_mtp_layers == 1
    assert cfg.weight_prefix == "model.language_model." and cfg.quant_method == "dgpp_mixed"


@pytest.fixture(scope="module")
def w4_plan(tmp_path_factory):
    path = _checkpoint(tmp_path_factory.mktemp("glm5_next_plan"))
    deploy = load_config(TEMPLATE)
    assert deploy.world == 4 and deploy.engine.mtp and deploy.engine.mtp_depth == 1
    ctx = LoadContext(path, GLM_5_3_FLASH, "glm", "Glm5NextForConditionalGeneration", engine=deploy.engine)
    ctx.world = World(0, 4)
    no_mtp = LoadContext(
        path,
        GLM_5_3_FLASH,
        "glm",
        "Glm5NextForConditionalGeneration",
        engine=msgspec.structs.replace(deploy.engine, mtp=False),
        world=World(0, 4),
    )
    return plan_for(build_manager(), ctx), plan_for(build_manager(), no_mtp)


def test_w4_plan_counts_latent_and_pooled_index_rows_per_token(w4_plan):
    plan, no_mtp = w4_plan
    # per indexed layer a BF16 latent row (512) and a quarter of a 128-wide pooled index key; the MTP layer adds one
    assert no_mtp.kv_per_token == 11 * (512 * 2 + 128 * 2 // 4) == 11_968
    assert plan.kv_per_token == 12 * (512 * 2 + 128 * 2 // 4) == 13_056


@pytest.mark.parametrize(
    ("kv_dtype", "latent_row"),
    [("fp8", 512 + 4), ("fp4", 288 + 4)],  # e4m3 codes / the packed fp4 row, each with an fp32 row scale
)
def test_w4_plan_counts_quantized_latent_and_index_rows(kv_dtype, latent_row, tmp_path_factory):
    """engine.kv_dtype fp8 / fp4 on the w4 template (MTP on): per indexed layer the quantized latent row and a
    quarter of an e4m3 pooled index key with its scale (128 + 4 bytes a pool): 13,056 B/token/rank become
    6,588 / 3,900."""
    path = _checkpoint(tmp_path_factory.mktemp("glm5_next_plan_kv"))
    engine = msgspec.structs.replace(load_config(TEMPLATE).engine, kv_dtype=kv_dtype)
    ctx = LoadContext(
        path, GLM_5_3_FLASH, "glm", "Glm5NextForConditionalGeneration", engine=engine, world=World(0, 4)
    )
    plan = plan_for(build_manager(), ctx)
    assert plan.kv_per_token == 12 * (latent_row + (128 + 4) // 4) in (6_588, 3_900)
    assert plan.fits(121 * GiB)


def test_w4_plan_counts_kda_state_per_request(w4_plan):
    plan, no_mtp = w4_plan
    # this rank's 16 of 64 KDA heads: an fp32 128 x 128 recurrent state per head, the conv window over q|k|v
    recurrent = 34 * 16 * 128 * 128 * 4
    assert recurrent <= no_mtp.state_per_request < recurrent + 8 * 2**20
    rings = 4 * 128 * 2 * 2  # the open pool's k and gate rows, BF16
    assert plan.state_per_request - no_mtp.state_per_request == rings


def test_w4_plan_counts_packed_weights_and_the_mtp_layer(w4_plan):
    plan, no_mtp = w4_plan
    # this rank's quarter of 42 layers x 288 NVFP4 experts (4.5 bits a weight: codes and E4M3 scales per 16); FP8
    # attention, dense and shared MLPs at a byte (+ scales), BF16 KDA projections, head and embedding make the rest
    experts = 42 * 288 * 3 * 2048 * 4096 * 9 // 16 // 4
    assert experts < no_mtp.weights < experts + 8 * GiB
    # the MTP layer at w4: a quarter of its 288 FP8 experts (1.7 GiB) and its MLA, eh_proj [H, 2H] replicated
    fp8_experts = 288 * 3 * 2048 * 4096 // 4
    assert plan.weights == no_mtp.weights and fp8_experts < plan.drafter < fp8_experts + GiB // 2
    assert plan.fits(121 * GiB)


def test_dgpp_check_passes_the_shipped_template(tmp_path, monkeypatch, capsys):
    """``dgpp check glm-5.3-flash_nvfp4-fp8_w4`` with the checkpoint (config and names) in the HF cache."""
    repo = tmp_path / "hub" / "models--HawkBearPig--GLM-5.3-Flash-NVFP4-FP8"
    _checkpoint(repo / "snapshots" / "rev0")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev0")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["check", "glm-5.3-flash_nvfp4-fp8_w4", "--free-gib", "121", "--headroom-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint   {MODEL}" in out and "ready" in out and "GLM-5.3-Flash plan" in out
    assert "lossy levers none" in out
    args = [
        "check",
        "glm-5.3-flash_nvfp4-fp8_w4",
        "--free-gib",
        "121",
        "--headroom-gib",
        "4",
        "--kv-dtype",
        "fp4",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    # 3,900 B/token (3.81 KiB) x 786,432 tokens: a 2.86 GiB pool where BF16 rows take 9.56 GiB
    assert "lossy levers kv_dtype" in out and "kv 3.81 KiB/token x 786432" in out and "ready" in out
