"""MiMo-V2-Flash (mimo_v2_flash) vs transformers on tiny random checkpoints: full-attention layers and sliding-window
layers (window 8, shorter than most prompts) with twice the KV heads and per-head sinks, q/k heads of 48 and v
heads of 32, RoPE on the first 16 dims with a theta per layer type, v scaled by 0.707 before caching, a dense
layer 0 then sigmoid-routed MoE layers with a correction bias and no shared expert. Prompts run both shorter
and longer than the window."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from dgpp.plugin_api import PagedKV, WindowKV
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.suite import (
    HybridConformance,
    KVFp8Lever,
    check_checkpoint_logits,
    tiny_checkpoint_fixtures,
)
from dgpp_mimo.model import MimoV2FlashForCausalLM
from dgpp_mimo.testing import build_tiny_mimo

transformers.logging.set_verbosity_error()
WINDOW = 8
checkpoint, fp32_pair = tiny_checkpoint_fixtures(build_tiny_mimo, "mimo")


def test_loads_both_attention_kinds_with_their_own_shapes(fp32_pair):
    model, _ = fp32_pair
    assert isinstance(model, MimoV2FlashForCausalLM) and model.info.hybrid
    spec = model.cache_spec()
    kinds = [type(spec[f"layers.{i}.self_attn"]).__name__ for i in range(6)]
    assert kinds == ["PagedKV", "WindowKV", "WindowKV", "WindowKV", "WindowKV", "PagedKV"]
    full, ring = spec["layers.0.self_attn"], spec["layers.1.self_attn"]
    assert isinstance(full, PagedKV) and (full.num_kv_heads, full.head_dim, full.v_dim) == (2, 48, 32)
    assert isinstance(ring, WindowKV)
    assert ring.tensors["k"][0] == (WINDOW - 1, 4, 48) and ring.tensors["v"][0] == (WINDOW - 1, 4, 32)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SwiGLUMLP"] + ["SparseMoE"] * 5
    assert [layer.self_attn.sinks is None for layer in model.model.layers] == [
        True,
        False,
        False,
        False,
        False,
        True,
    ]
    assert float(model.model.layers[1].self_attn.sinks.abs().min()) > 0  # loaded from attention_sink_bias
    assert [layer.self_attn.rotary.rotary_dim for layer in model.model.layers] == [16] * 6
    assert float(model.model.layers[1].mlp.gate.e_score_correction_bias.abs().min()) > 0


class TestMimoConformance(HybridConformance):
    """Prompts shorter and longer than the window; chunks shorter and longer than it are bit-identical to
    one-shot (the ring gives each chunk exactly the keys the one-shot prompt had in place)."""


def _misses_transformers(model, ref) -> None:
    with pytest.raises(AssertionError, match="logits differ"):
        conf.check_logits(model, ref, conf.make_prompts(model.info.vocab_size, (5, 23)), rtol=1e-3)


def test_removing_the_sinks_breaks_the_match(fp32_pair):
    """Teeth: with every sink pushed to -inf (no sink term) the logits leave transformers' by far more than 1e-4."""
    model, ref = fp32_pair
    sliding = [layer.self_attn for layer in model.model.layers if layer.self_attn.sinks is not None]
    saved = [attn.sinks.clone() for attn in sliding]
    try:
        for attn in sliding:
            attn.sinks.fill_(-1e30)
        _misses_transformers(model, ref)
    finally:
        for attn, sinks in zip(sliding, saved, strict=True):
            attn.sinks.copy_(sinks)


def test_removing_the_value_scale_breaks_the_match(fp32_pair):
    """Teeth: values cached unscaled (scale 1 instead of 0.707) miss transformers."""
    model, ref = fp32_pair
    try:
        for layer in model.model.layers:
            layer.self_attn.value_scale = 1.0
        _misses_transformers(model, ref)
    finally:
        for layer in model.model.layers:
            layer.self_attn.value_scale = model.config.attention_value_scale


def _variant(checkpoint, tmp_path, **config):
    """The same weights under an edited config.json."""
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    base = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return load_model(tmp_path)


def test_removing_the_window_breaks_the_match(checkpoint, fp32_pair, tmp_path):
    """Teeth: the same weights with a window wider than every prompt match transformers on prompts inside the
    window and miss it, well past 1e-4, on the prompt that runs past the window."""
    _, ref = fp32_pair
    wide = _variant(checkpoint, tmp_path, sliding_window=64)
    short, long = conf.make_prompts(wide.info.vocab_size, (WINDOW, 23))
    conf.check_logits(wide, ref, [short], rtol=1e-4)
    with pytest.raises(AssertionError, match="logits differ"):
        conf.check_logits(wide, ref, [long], rtol=1e-3)


def test_one_theta_for_both_layer_types_breaks_the_match(checkpoint, fp32_pair, tmp_path):
    """Teeth for RoPE per layer type: the full layers rotated with the sliding layers' theta miss transformers."""
    _, ref = fp32_pair
    base = json.loads((checkpoint / "config.json").read_text())["rope_parameters"]
    same = _variant(
        checkpoint, tmp_path, rope_parameters={**base, "full_attention": base["sliding_attention"]}
    )
    _misses_transformers(same, ref)


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"],
            "num_hidden_layers": 4,
            "sliding_window": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 2.5,
        },
        {
            "tie_word_embeddings": True,
            "sliding_window": 5,
            "attention_bias": True,
            "attention_value_scale": 1.3,
            "num_key_value_heads": 4,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 3,
        },
        {
            "head_dim": 64,
            "v_head_dim": 64,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 1.0,
                },
            },
        },
    ],
    ids=["window_2_sliding_first_no_renorm", "tied_bias_groups_window_5", "equal_dims_full_rotary"],
)
def test_variants_match_transformers(overrides, tmp_path):
    check_checkpoint_logits(build_tiny_mimo(tmp_path, seed=7, **overrides), (3, 18), seed=8, rtol=1e-4)


def test_bf16_logits_within_tolerance(tmp_path):
    path = build_tiny_mimo(tmp_path, seed=5, dtype=torch.bfloat16)
    model = check_checkpoint_logits(path, (6, 21), seed=6, rtol=3e-2, max_outlier_rows=0.15)
    assert model.info.dtype == torch.bfloat16


class TestMimoKVFp8(KVFp8Lever):
    """``engine.kv_dtype: fp8`` on MiMo's paged full layers and sliding rings (q/k 48 wide, v 32), against the exact chain; the prefix hit cuts past the window."""
