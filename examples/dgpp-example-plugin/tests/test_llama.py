"""The Llama family against transformers on tiny random checkpoints that transformers saves itself, through
dgpp's conformance kit (``dgpp.testing``): logits, greedy tokens, chunked and mixed batches, bit-exact batch
invariance, every RoPE scaling type, bf16, and the error messages. Run with ``pytest tests`` from this directory
(or from the dgpp repository, whose test command includes it)."""

from __future__ import annotations

import pytest
import torch

from dgpp.plugin_api import CheckpointError, ConfigError, load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint, load_reference
from dgpp.testing.suite import KVFp8Lever

pytest.importorskip("dgpp_llama", reason="install this plugin first: pip install -e .")

VARIANTS = {
    "plain": {},
    "tied_biased": {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
    },
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
        }
    },
}


@pytest.fixture(scope="module")
def fp32_pair(tmp_path_factory):
    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return load_model(path), load_reference(path)


def test_the_plugin_serves_llama(fp32_pair):
    model, _ = fp32_pair
    assert type(model).__module__ == "dgpp_llama.model" and model.info.dtype == torch.float32


def test_logits_match_transformers_on_mixed_length_batch(fp32_pair):
    model, ref = fp32_pair
    assert conf.check_logits(model, ref, conf.make_prompts(model.info.vocab_size), rtol=1e-4) < 1e-4


def test_32_greedy_tokens_match_transformers_generate(fp32_pair):
    model, ref = fp32_pair
    conf.check_greedy(
        model, ref, conf.make_prompts(model.info.vocab_size, (7, 19), seed=1), max_new_tokens=32
    )


def test_chunked_prefill_and_mixed_batches_equal_one_shot(fp32_pair):
    model, _ = fp32_pair
    conf.check_chunked_prefill(
        model, conf.make_prompts(model.info.vocab_size, (11, 23), seed=2), chunk_sizes=(1, 5, 16)
    )
    conf.check_mixed_batch(model, conf.make_prompts(model.info.vocab_size, (3, 17, 9), seed=3))


def test_logits_are_bit_identical_alone_batched_and_chunked(fp32_pair):
    model, _ = fp32_pair
    prompts = conf.make_prompts(model.info.vocab_size, (1, 3, 9, 7), seed=14)
    conf.check_batch_invariance(model, prompts)
    conf.check_chunk_invariance(model, prompts, chunk_sizes=(1, 4))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "plain"])
def test_config_variants_match_transformers(variant, tmp_path):
    overrides = {**VARIANTS[variant], "max_position_embeddings": 512}
    path = build_tiny_checkpoint("llama", tmp_path, seed=21, overrides=overrides)
    model, ref = load_model(path), load_reference(path)
    # long prompts reach the scaled low frequencies of linear / llama3 / yarn
    prompts = conf.make_prompts(model.info.vocab_size, (5, 40, 150), seed=22)
    assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4
    conf.check_greedy(model, ref, prompts[:1], max_new_tokens=16)


def test_bf16_greedy_matches_within_near_ties(tmp_path):
    path = build_tiny_checkpoint("llama", tmp_path, dtype=torch.bfloat16, seed=5)
    model, ref = load_model(path), load_reference(path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompts = conf.make_prompts(model.info.vocab_size, (6, 13), seed=6)
    conf.check_logits(model, ref, prompts, rtol=3e-2)
    assert conf.check_greedy_near_ties(model, ref, prompts, max_new_tokens=16, rtol=3e-2) <= len(prompts)


def test_errors_name_the_key_and_the_tensor(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    path = build_tiny_checkpoint("llama", tmp_path / "ok", seed=3)
    cfg = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(
        json.dumps({**cfg, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    )
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"'rope_parameters.rope_type'='dynamic' is not supported"):
        load_model(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match=r"'hidden_act'='gelu' is not supported"):
        load_model(bad)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    (bad / "model.safetensors").unlink()
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight'.*missing from .*model.safetensors"
    ):
        load_model(bad)


class TestLlamaKVFp8(KVFp8Lever):
    """``engine.kv_dtype: fp8`` on the example plugin's paged GQA cache (core's attention), against the exact chain."""
