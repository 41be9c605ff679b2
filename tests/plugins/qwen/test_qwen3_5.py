"""Qwen3.5 hybrids (qwen3_5 dense, qwen3_5_moe, and both ConditionalGeneration wrappers) vs transformers on tiny
random fp32 checkpoints saved by transformers: cache spec, logits on a mixed-length batch, 32 greedy tokens."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.cache_spec import PagedKV, StateSpec
from dgpp.engine.loading import load_model
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
    assert spec["layers.1"] == PagedKV(num_kv_heads=2, head_dim=16, dtype=torch.float32)
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
