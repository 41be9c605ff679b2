"""qwen4_exp per-request state and table modes: chunked prefill ≡ one-shot, batched ≡ solo, state snapshot and
restore (GDN, PLE n-gram context and conv history, QSA/indexer pages), mmap ≡ resident n-gram table, and YaRN
through ``engine.rope_scaling`` vs transformers' YaRN."""

from __future__ import annotations

import pytest
import torch

from dgpp.plugin_api import EngineConfig, EngineRopeScaling
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp_qwen.testing_qwen4_exp import EOS, TINY_QWEN4_EXP, build_tiny_qwen4_exp


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_qwen4_exp(tmp_path_factory.mktemp("qwen4_exp_state"), seed=5)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


def _prompts(model, lengths, seed):
    prompts = conf.make_prompts(model.info.vocab_size, lengths, seed=seed)
    prompts[-1][4] = EOS
    return prompts


def _assert_rows_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    """Close, not bit-identical: the shared GDN prefill (dgpp.nn.gated_deltanet) rounds differently with the
    chunk length and with the padded batch it solves in; every qwen4_exp-specific op is row-independent."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(
            a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()), msg=f"{what}: prompt {i}"
        )


def test_chunked_prefill_logits_equal_one_shot(model):
    prompts = _prompts(model, (13, 41), seed=6)
    one_shot = conf.engine_all_logits(model, prompts)
    for size in (1, 6, 17):
        _assert_rows_close(conf.engine_all_logits(model, prompts, chunk_size=size), one_shot, f"chunk {size}")


def test_chunked_prefill_greedy_equals_one_shot(model):
    conf.check_chunked_prefill(
        model, _prompts(model, (11, 37), seed=7), chunk_sizes=(1, 5, 16), max_new_tokens=10
    )


def test_batched_logits_equal_solo(model):
    prompts = _prompts(model, (5, 22, 40), seed=8)
    together = conf.engine_all_logits(model, prompts)
    _assert_rows_close(together, [conf.engine_all_logits(model, [p])[0] for p in prompts], "batched vs solo")


def test_mixed_prefill_decode_batch_equals_each_alone(model):
    conf.check_mixed_batch(model, _prompts(model, (3, 17, 33), seed=9), max_new_tokens=10)


def test_state_snapshot_restore_reproduces_continuation(model):
    # split below the dense limit (19), continuation crosses it: indexer pages and PLE state both matter
    conf.check_state_snapshot(model, _prompts(model, (30,), seed=10)[0], split=15, max_new_tokens=10)


@torch.inference_mode()
def test_mmap_table_equals_resident(checkpoint, model):
    mapped = load_model(checkpoint, EngineConfig(ngram_table="mmap"))
    embedding = mapped.model.layers[0].ple.ple_embedding
    assert (
        embedding.mode == "mmap"
        and embedding.table is None
        and len(embedding.parts) == TINY_QWEN4_EXP["split_ngram_parts"]
    )
    prompts = _prompts(model, (9, 35), seed=11)
    for ours, theirs in zip(
        conf.engine_all_logits(mapped, prompts), conf.engine_all_logits(model, prompts), strict=True
    ):
        assert torch.equal(ours, theirs)


def test_engine_rope_scaling_yarn_matches_transformers_yarn(checkpoint, model):
    import transformers

    scaling = EngineRopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    yarn_model = load_model(checkpoint, EngineConfig(rope_scaling=scaling))
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    config.rope_parameters = {
        **TINY_QWEN4_EXP["rope_parameters"],
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    reference = transformers.Qwen4ExpForCausalLM.from_pretrained(
        checkpoint, config=config, attn_implementation="eager"
    ).eval()
    prompts = _prompts(model, (12, 40), seed=12)
    assert conf.check_logits(yarn_model, reference, prompts, rtol=1e-4) < 1e-4
    plain, scaled = (
        conf.engine_all_logits(model, prompts[1:])[0],
        conf.engine_all_logits(yarn_model, prompts[1:])[0],
    )
    assert (plain - scaled).abs().max() / plain.abs().max() > 1e-3  # YaRN really changed the frequencies
