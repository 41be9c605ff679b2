"""Flint (flint) vs transformers on tiny random checkpoints: full-attention layers without RoPE and sliding-window
layers (window 8, shorter than most prompts) with per-head sinks on both, per-head q/k norms, dense layers then
MoE layers with an ungated shared expert. Prompts run both shorter and longer than the window."""

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
from dgpp_flint.model import FlintForCausalLM
from dgpp_flint.testing import build_tiny_flint

transformers.logging.set_verbosity_error()
WINDOW = 8
checkpoint, fp32_pair = tiny_checkpoint_fixtures(build_tiny_flint, "flint")


def test_loads_both_attention_kinds_dense_and_moe_layers(fp32_pair):
    model, _ = fp32_pair
    assert isinstance(model, FlintForCausalLM) and model.info.hybrid
    spec = model.cache_spec()
    kinds = [type(spec[f"layers.{i}.self_attn"]).__name__ for i in range(6)]
    assert kinds == ["PagedKV", "PagedKV", "WindowKV", "WindowKV", "WindowKV", "PagedKV"]
    ring = spec["layers.2.self_attn"]
    assert isinstance(ring, WindowKV) and ring.tensors["k"][0][0] == WINDOW - 1
    assert isinstance(spec["layers.0.self_attn"], PagedKV)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SwiGLUMLP"] * 2 + ["SparseMoE"] * 4
    assert [layer.self_attn.rotary is None for layer in model.model.layers] == [
        True,
        True,
        False,
        False,
        False,
        True,
    ]
    assert float(model.model.layers[0].self_attn.sinks.abs().min()) > 0  # loaded from softmax_offset


class TestFlintConformance(HybridConformance):
    """Prompts shorter and longer than the window; chunks shorter and longer than it are bit-identical to
    one-shot (the ring gives each chunk exactly the keys the one-shot prompt had in place)."""


def test_removing_the_sinks_breaks_the_match(fp32_pair):
    """Teeth: with every sink pushed to -inf (no sink term) the logits leave transformers' by far more than 1e-4."""
    model, ref = fp32_pair
    saved = [layer.self_attn.sinks.clone() for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e30)
        with pytest.raises(AssertionError, match="logits differ"):
            conf.check_logits(model, ref, conf.make_prompts(model.info.vocab_size, (5, 23)), rtol=1e-3)
    finally:
        for layer, sinks in zip(model.model.layers, saved, strict=True):
            layer.self_attn.sinks.copy_(sinks)


def test_removing_the_window_breaks_the_match(checkpoint, fp32_pair, tmp_path):
    """Teeth: the same weights with a window wider than every prompt match transformers on prompts inside the
    window and miss it, well past 1e-4, on the prompt that runs past the window."""
    _, ref = fp32_pair
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    wide = load_model(tmp_path)
    short, long = conf.make_prompts(wide.info.vocab_size, (WINDOW, 23))
    conf.check_logits(wide, ref, [short], rtol=1e-4)
    with pytest.raises(AssertionError, match="logits differ"):
        conf.check_logits(wide, ref, [long], rtol=1e-3)


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "num_hidden_layers": 4,
            "mlp_only_layers": [1],
            "sliding_window": 2,
            "norm_topk_prob": False,
        },
        {"decoder_sparse_step": 2, "tie_word_embeddings": True, "sliding_window": 5},
    ],
    ids=["window_2_sliding_first_no_renorm", "sparse_step_tied_window_5"],
)
def test_variants_match_transformers(overrides, tmp_path):
    check_checkpoint_logits(build_tiny_flint(tmp_path, seed=7, **overrides), (3, 18), seed=8, rtol=1e-4)


def test_bf16_logits_within_tolerance(tmp_path):
    path = build_tiny_flint(tmp_path, seed=5, dtype=torch.bfloat16)
    model = check_checkpoint_logits(path, (6, 21), seed=6, rtol=3e-2, max_outlier_rows=0.15)
    assert model.info.dtype == torch.bfloat16


class TestFlintKVFp8(KVFp8Lever):
    """``engine.kv_dtype: fp8`` on Flint's paged full layers and sliding rings (both with sinks), against the exact chain; the prefix hit cuts past the window."""
