"""glm5_next config.json -> Glm5NextArchConfig: nested and flat forms, the release's defaults and own keys, and
refusals that name the key."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dgpp.plugin_api import ConfigError
from dgpp.startup.loading import load_model
from dgpp_glm.glm5_next_config import INDEXED, LINEAR, Glm5NextArchConfig
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next, tiny_glm5_next_text_config

# GLM-5.3-Flash's text model as the release's config.json states it (the keys transformers' defaults do not fill)
RELEASE_TEXT: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 45,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 256,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "n_routed_experts": 288,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "index_kpool": 4,
    "pad_token_id": 154820,
    # keys only the release's own parser reads
    "linear_attn_config": {
        "num_heads": 64,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3],
    },
    "mla_use_nope": True,
    "index_kpool_compress": True,
    "indexer_rope_interleave": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_router_dtype": "float32",
    "mhc": True,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
}


def test_release_config_nested_and_flat_read_alike():
    nested = Glm5NextArchConfig.from_hf_config(
        {"model_type": "glm5_next", "text_config": RELEASE_TEXT, "dtype": "bfloat16", "eos_token_id": [7, 8]}
    )
    flat = Glm5NextArchConfig.from_hf_config(
        {"model_type": "glm5_next", **RELEASE_TEXT, "dtype": "bfloat16", "eos_token_id": [7, 8]}
    )
    assert nested.weight_prefix == "model.language_model." and flat.weight_prefix == "model."
    for cfg in (nested, flat):
        assert cfg.layer_types.count(LINEAR) == 34 and cfg.layer_types.count(INDEXED) == 11
        assert all(cfg.is_linear(i) == (i % 4 != 3) for i in range(45))
        assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
        assert set(cfg.indexer_types) == {"full"}
        assert (cfg.index_kpool, cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (4, 2048, 32, 128)
        assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel) == (64, 128, 4)
        assert cfg.linear_lower_bound == -5.0
        assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps) == (4, 20, 1e-6)
        assert cfg.swiglu_limit == 10.0 and cfg.num_mtp_layers == 1
        assert cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == (7, 8)


def test_legacy_layer_type_names_mean_indexed():
    types = ["linear_attention", "deepseek_sparse_attention", "full_attention", "linear_attention"]
    cfg = Glm5NextArchConfig.from_hf_config({**RELEASE_TEXT, "num_hidden_layers": 4, "layer_types": types})
    assert cfg.layer_types == (LINEAR, INDEXED, INDEXED, LINEAR)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
        ({"index_topk": 2050}, "index_topk"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["linear_attention"] * 44 + ["sliding_attention"]}, "layer_types"),
        ({"indexer_types": ["full"] * 7 + ["shared"] + ["full"] * 37}, "indexer_types"),
        ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail"),
    ],
)
def test_refusals_name_the_key(change, named):
    with pytest.raises(ConfigError, match=named):
        Glm5NextArchConfig.from_hf_config({"text_config": {**RELEASE_TEXT, **change}})


def test_nested_refusal_names_the_text_config_key():
    with pytest.raises(ConfigError, match="text_config.qk_rope_head_dim"):
        Glm5NextArchConfig.from_hf_config({"text_config": {**RELEASE_TEXT, "qk_rope_head_dim": 64}})


def test_flat_checkpoint_loads_from_model_prefix(tmp_path):
    """A flat config keeps the text model under ``model.``: the tiny checkpoint's tensors renamed so load alike
    (the nested one also loads its vision tower, ``model.visual.``; the flat one has none)."""
    import json

    from safetensors.torch import load_file, save_file

    nested = build_tiny_glm5_next(tmp_path / "nested", seed=1)
    tensors = load_file(nested / "model.safetensors")
    flat_dir = tmp_path / "flat"
    flat_dir.mkdir()
    flat = {
        k.replace("model.language_model.", "model."): v
        for k, v in tensors.items()
        if not k.startswith("model.visual")
    }
    save_file(flat, flat_dir / "model.safetensors")
    config = {
        "architectures": ["Glm5NextForCausalLM"],
        "model_type": "glm5_next",
        **tiny_glm5_next_text_config(),
        "dtype": "float32",
    }
    (flat_dir / "config.json").write_text(json.dumps(config))
    a, b = load_model(nested), load_model(flat_dir)
    assert a.nested and not b.nested
    assert a.visual is not None and b.visual is None
    text_a = [(n, p) for n, p in a.named_parameters() if not n.startswith("model.visual.")]
    for (name_a, pa), (name_b, pb) in zip(text_a, b.named_parameters(), strict=True):
        assert name_a.replace("model.language_model.", "model.") == name_b
        assert torch.equal(pa, pb), name_a


# the release's vision_config (out_hidden_size is the text model's hidden size)
RELEASE_VISION: dict[str, Any] = {"depth": 24, "hidden_size": 1024, "num_heads": 16, "out_hidden_size": 4096}


def test_release_vision_config_reads_the_tower():
    cfg = Glm5NextArchConfig.from_hf_config({"text_config": RELEASE_TEXT, "vision_config": RELEASE_VISION})
    vision = cfg.vision
    assert vision is not None
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.head_dim) == (24, 1024, 16, 64)
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (14, 2, 2)
    assert (vision.intermediate_size, vision.projection_intermediate_size) == (4096, 10240)
    assert vision.swiglu_limit == 10.0 and vision.patch_values == 3 * 2 * 14 * 14
    flat = Glm5NextArchConfig.from_hf_config({**RELEASE_TEXT, "vision_config": RELEASE_VISION})
    assert flat.vision is None  # a flat config is the text model alone


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"out_hidden_size": 1536}, "vision_config.out_hidden_size"),
        ({"hidden_act": "gelu"}, "vision_config.hidden_act"),
        ({"rope_parameters": {"rope_type": "default"}}, "vision_config.rope_parameters"),
        ({"num_heads": 12}, "vision_config.hidden_size"),
    ],
)
def test_vision_refusals_name_the_key(change, named):
    with pytest.raises(ConfigError, match=named):
        Glm5NextArchConfig.from_hf_config(
            {"text_config": RELEASE_TEXT, "vision_config": {**RELEASE_VISION, **change}}
        )
