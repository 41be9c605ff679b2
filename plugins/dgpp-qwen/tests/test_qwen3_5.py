"""Qwen3.5 hybrids (qwen3_5 dense, qwen3_5_moe, and both ConditionalGeneration wrappers) vs transformers on tiny
random fp32 checkpoints saved by transformers: cache spec, logits on a mixed-length batch, 32 greedy tokens."""

from __future__ import annotations

import pytest
import torch

from dgpp.startup.loading import load_model
from dgpp.step.cache_spec import PagedKV, StateSpec
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint, load_reference

KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl")
PROMPT_LENS = (5, 17, 70, 9)  # 70 > the 64-token GDN chunk, so prefill crosses a chunk boundary


@pytest.fixture(scope="module", params=KINDS)
def fp32_pair(request, tmp_path_factory):
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(path), load_reference(path)


def test_cache_spec_follows_layer_types(fp32_pair):
    model, _ = fp32_pair
    spec = model.cache_spec()
    assert list(spec) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert [type(s) for s in spec.values()] == [StateSpec, PagedKV, StateSpec, PagedKV]
    gdn = spec["layers.0"].tensors
    assert gdn["recurrent"] == ((4, 16, 16), torch.float32)  # [v heads, k dim, v dim], always fp32
    assert gdn["conv"] == ((3, 2 * 2 * 16 + 4 * 16), torch.float32)  # last kernel-1 inputs of [q|k|v]
    assert spec["layers.1"] == PagedKV(num_kv_heads=2, head_dim=16, dtype=torch.float32, fp8_rows=True)
    assert model.info.hybrid


def test_logits_match_transformers_on_mixed_length_batch(fp32_pair):
    model, ref = fp32_pair
    worst = conf.check_logits(model, ref, conf.make_prompts(model.info.vocab_size, PROMPT_LENS), rtol=1e-4)
    assert worst < 1e-4


def test_32_greedy_tokens_match_transformers_generate(fp32_pair):
    model, ref = fp32_pair
    prompts = conf.make_prompts(model.info.vocab_size, (7, 66), seed=1)
    conf.check_greedy(model, ref, prompts, max_new_tokens=32)


@pytest.mark.parametrize("kind", ("qwen3_5", "qwen3_5_vl"))
def test_tied_embeddings(kind, tmp_path):
    """Small Qwen3.5 releases tie the head to the embedding (no lm_head tensor in the checkpoint)."""
    path = build_tiny_checkpoint(kind, tmp_path, seed=4, overrides={"tie_word_embeddings": True})
    model, ref = load_model(path), load_reference(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    conf.check_logits(model, ref, conf.make_prompts(model.info.vocab_size, (8, 21), seed=5), rtol=1e-4)


def _release_config() -> dict:
    """Qwen3.8-27B's geometry in the release's config.json shape (multimodal wrapper)."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": "bfloat16",
        "text_config": {
            "model_type": "qwen3_5_text",
            "vocab_size": 248320,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "full_attention_interval": 4,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
        },
        "vision_config": {"depth": 27},
    }


@pytest.mark.parametrize("world_size", (1, 2))
def test_release_geometry_builds_with_the_expected_cache(world_size):
    """The 27B's real sizes, built on the meta device: 48 GDN + 16 attention layers, per-rank state and K/V."""
    from dgpp.family import World
    from dgpp_qwen.config import QwenConfig
    from dgpp_qwen.qwen3_5 import Qwen35ForCausalLM

    cfg = QwenConfig.from_hf_config(_release_config())
    with torch.device("meta"):
        model = Qwen35ForCausalLM(cfg, World(rank=0, size=world_size))
    spec = model.cache_spec()
    gdn = [s for s in spec.values() if isinstance(s, StateSpec)]
    attn = [s for s in spec.values() if isinstance(s, PagedKV)]
    assert (len(gdn), len(attn)) == (48, 16)
    assert isinstance(spec["layers.3"], PagedKV) and isinstance(spec["layers.4"], StateSpec)
    assert gdn[0].tensors["recurrent"] == ((48 // world_size, 128, 128), torch.float32)
    assert gdn[0].tensors["conv"] == ((3, (2 * 16 * 128 + 48 * 128) // world_size), torch.bfloat16)
    assert attn[0] == PagedKV(num_kv_heads=4 // world_size, head_dim=256, dtype=torch.bfloat16, fp8_rows=True)
    per_request = sum(s.bytes_per_request() for s in gdn)
    assert per_request == 48 * (48 * 128 * 128 * 4 + 3 * 10240 * 2) // world_size  # ≈ 147 MiB at TP1
    assert model.model.layers[3].self_attn.rotary.rotary_dim == 64
