"""Qwen3 and Qwen3-MoE vs transformers on tiny random checkpoints saved by transformers itself."""

from __future__ import annotations

import pytest
import torch

from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint, load_reference

KINDS = ("qwen3", "qwen3_moe")
# bf16 keeps 8 mantissa bits: two implementations that round at different places drift ~1e-2 apart
# over 2 layers. MoE rows may also flip an expert at a router near-tie (a whole-row jump), so up to
# 10% of rows may exceed the bound there; the greedy tokens must match regardless.
BF16_RTOL = 3e-2
BF16_OUTLIER_ROWS = {"qwen3": 0.0, "qwen3_moe": 0.1}


@pytest.fixture(scope="module", params=KINDS)
def fp32_pair(request, tmp_path_factory):
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, load_model(path), load_reference(path)


def test_logits_match_transformers_on_mixed_length_batch(fp32_pair):
    _, model, ref = fp32_pair
    worst = conf.check_logits(model, ref, conf.make_prompts(model.info.vocab_size), rtol=1e-4)
    assert worst < 1e-4


def test_32_greedy_tokens_match_transformers_generate(fp32_pair):
    _, model, ref = fp32_pair
    conf.check_greedy(
        model, ref, conf.make_prompts(model.info.vocab_size, (7, 19), seed=1), max_new_tokens=32
    )


def test_chunked_prefill_equals_one_shot(fp32_pair):
    _, model, _ = fp32_pair
    conf.check_chunked_prefill(
        model, conf.make_prompts(model.info.vocab_size, (11, 23), seed=2), chunk_sizes=(1, 5, 16)
    )


def test_mixed_prefill_decode_batch_equals_solo(fp32_pair):
    _, model, _ = fp32_pair
    conf.check_mixed_batch(model, conf.make_prompts(model.info.vocab_size, (3, 17, 9), seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_bit_identical_alone_batched_and_chunked(fp32_pair, dtype, tmp_path):
    kind, model, _ = fp32_pair
    if dtype != torch.float32:
        model = load_model(build_tiny_checkpoint(kind, tmp_path, dtype=dtype, seed=13))
    # 1..3 rows per prompt alone vs 20 rows together: different GEMM shapes on the CPU
    prompts = conf.make_prompts(model.info.vocab_size, (1, 3, 9, 7), seed=14)
    conf.check_batch_invariance(model, prompts)
    conf.check_chunk_invariance(model, prompts, chunk_sizes=(1, 4))


def test_kv_continuation_is_reproducible(fp32_pair):
    _, model, _ = fp32_pair
    conf.check_state_snapshot(model, conf.make_prompts(model.info.vocab_size, (14,), seed=4)[0], split=6)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_logits_within_tolerance_and_greedy_matches(kind, tmp_path):
    path = build_tiny_checkpoint(kind, tmp_path, dtype=torch.bfloat16, seed=5)
    model, ref = load_model(path), load_reference(path)
    assert model.info.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompts = conf.make_prompts(model.info.vocab_size, (6, 13, 29), seed=6)
    conf.check_logits(model, ref, prompts, rtol=BF16_RTOL, max_outlier_rows=BF16_OUTLIER_ROWS[kind])
    # teacher-forced along transformers' greedy path, through our decode steps: a differing pick is
    # only allowed at a near-tie within the bf16 tolerance, and at most once per prompt
    ties = conf.check_greedy_near_ties(model, ref, prompts, max_new_tokens=16, rtol=BF16_RTOL)
    assert ties <= len(prompts)


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("qwen3", {"tie_word_embeddings": True}),
        ("qwen3", {"attention_bias": True}),
        (
            "qwen3",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("qwen3_moe", {"mlp_only_layers": [0], "norm_topk_prob": False}),
        ("qwen3_moe", {"decoder_sparse_step": 2}),
    ],
    ids=["tied", "attn_bias", "yarn", "mlp_only_layers", "sparse_step"],
)
def test_variants_match_transformers(kind, overrides, tmp_path):
    path = build_tiny_checkpoint(kind, tmp_path, seed=7, overrides=overrides)
    model, ref = load_model(path), load_reference(path)
    conf.check_logits(model, ref, conf.make_prompts(model.info.vocab_size, (4, 70), seed=8), rtol=1e-4)


def test_sharded_checkpoint_loads_identically(tmp_path):
    whole = build_tiny_checkpoint("qwen3_moe", tmp_path / "whole", seed=9)
    sharded = build_tiny_checkpoint("qwen3_moe", tmp_path / "sharded", seed=9, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists()
    prompts = conf.make_prompts(512, (9,), seed=10)
    a = greedy_generate(load_model(whole), prompts, 4)
    b_model = load_model(sharded)
    assert greedy_generate(b_model, prompts, 4) == a
    ref_a = conf.engine_all_logits(load_model(whole), prompts)[0]
    assert torch.equal(conf.engine_all_logits(b_model, prompts)[0], ref_a)


def test_generation_config_eos_stops_generation(tmp_path):
    path = build_tiny_checkpoint("qwen3", tmp_path, seed=11)
    model = load_model(path)
    prompt = conf.make_prompts(512, (8,), seed=12)
    free = greedy_generate(model, prompt, 6)[0]
    (path / "generation_config.json").write_text(f'{{"eos_token_id": [{free[2]}, 3]}}')
    model = load_model(path)
    assert free[2] in model.info.eos_token_ids
    assert greedy_generate(model, prompt, 6)[0] == free[: free.index(free[2]) + 1]


def test_fp32_checkpoint_loaded_in_bf16(fp32_pair, tmp_path):
    kind, model, _ = fp32_pair
    path = build_tiny_checkpoint(kind, tmp_path, seed=0)  # the fixture's checkpoint (same kind and seed)
    bf16 = load_model(path, dtype=torch.bfloat16)
    assert bf16.info.dtype == torch.bfloat16 and {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    prompts = conf.make_prompts(512, (6, 11), seed=15)
    for a, b in zip(
        conf.engine_all_logits(bf16, prompts), conf.engine_all_logits(model, prompts), strict=True
    ):
        assert float((a - b).abs().max() / b.abs().max()) < BF16_RTOL
