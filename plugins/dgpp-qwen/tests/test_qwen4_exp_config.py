"""qwen4_exp config and checkpoint handling: the multimodal release layout (text under ``text_config`` and
``model.language_model.``) vs transformers, and one clear error, naming the key or tensor, for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.errors import CheckpointError, ConfigError
from dgpp.startup.loading import load_model
from dgpp.step.cache_spec import StateSpec
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_qwen.qwen4_exp_config import Qwen4ExpConfig
from dgpp_qwen.testing_qwen4_exp import TINY_QWEN4_EXP, build_tiny_qwen4_exp


def test_wrapped_release_layout_matches_transformers(tmp_path):
    path = build_tiny_qwen4_exp(tmp_path, seed=21, wrapped=True)
    model, reference = load_model(path), load_reference(path)
    assert model.cfg.base.weight_prefix == "model.language_model."
    prompts = conf.make_prompts(model.info.vocab_size, (8, 33), seed=22)
    assert conf.check_logits(model, reference, prompts, rtol=1e-4) < 1e-4


def test_sigmoid_gdn_output_gate_matches_transformers(tmp_path):
    """``output_gate_type: sigmoid`` (the GDN norm gated by σ(z), as the release defines it)."""
    path = build_tiny_qwen4_exp(tmp_path, seed=27, overrides={"output_gate_type": "sigmoid"})
    model, reference = load_model(path), load_reference(path)
    assert model.cfg.gdn_output_gate == "sigmoid"
    prompts = conf.make_prompts(model.info.vocab_size, (7, 30), seed=28)
    assert conf.check_logits(model, reference, prompts, rtol=1e-4) < 1e-4


def _text(**changes):
    return {
        "model_type": "qwen4_exp_text",
        "architectures": ["Qwen4ExpForCausalLM"],
        **TINY_QWEN4_EXP,
        **changes,
    }


def test_parsed_fields():
    cfg = Qwen4ExpConfig.from_hf_config(_text())
    assert cfg.base.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.base.rope.rotary_dim == 8 and cfg.indexer.block_topk == 4 and cfg.hc_count == 4
    assert cfg.ngram.layer_ids == (0, 2) and cfg.ngram.num_heads == 16 and cfg.ngram.eos_token_id == 7
    # transformers' default for qwen4_exp is full-width RoPE when partial_rotary_factor is absent
    plain = Qwen4ExpConfig.from_hf_config(_text(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.base.rope.rotary_dim == 16


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
        ({"indexer_budget": 18}, "indexer_budget"),
        ({"indexer_head_dim": None}, "indexer_head_dim"),
        ({"output_gate_type": "gelu"}, "output_gate_type"),
        ({"hc_count": 1}, "hc_count"),
        ({"ple_layer_ids": [2]}, "ple_layer_ids"),
        ({"ple_embed_dim": 60}, "ple_embed_dim"),
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
    ],
)
def test_bad_config_names_the_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        Qwen4ExpConfig.from_hf_config(_text(**changes))


def test_wrapped_config_errors_name_text_config_keys():
    text = {**TINY_QWEN4_EXP, "indexer_kv_heads": 2}
    with pytest.raises(ConfigError, match=r"text_config\.indexer_kv_heads"):
        Qwen4ExpConfig.from_hf_config({"model_type": "qwen4_exp", "text_config": text})
    text = {**TINY_QWEN4_EXP, "num_hidden_layers": None}
    with pytest.raises(ConfigError, match=r"text_config\.num_hidden_layers"):
        Qwen4ExpConfig.from_hf_config({"model_type": "qwen4_exp", "text_config": text})


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_ngram_shard_names_the_tensor(tmp_path):
    path = build_tiny_qwen4_exp(tmp_path, seed=23)
    name = "model.layers.2.ple.ple_embedding.ngram_embedding.shard_3.weight"
    _rewrite(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(path)


def test_hash_constants_disagreeing_with_the_config_are_refused(tmp_path):
    path = build_tiny_qwen4_exp(tmp_path, seed=24)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "seed": 99}))
    with pytest.raises(CheckpointError, match="layer_multipliers"):
        load_model(path)


def test_memory_plan_counts_indexer_keys_ple_state_and_table_mode(tmp_path):
    from dgpp.family import LoadContext
    from dgpp.plugin_api import EngineConfig
    from dgpp.plugins import manager
    from dgpp.startup.loading import read_hf_config
    from dgpp.startup.memory_plan import plan_for
    from dgpp_qwen.memory import ngram_table_bytes

    path = build_tiny_qwen4_exp(tmp_path, seed=25, with_mtp=True)

    def plan(**engine):
        return plan_for(
            manager(),
            LoadContext(path, read_hf_config(path), "qwen", "Qwen4ExpForCausalLM", EngineConfig(**engine)),
        )

    resident, mapped, with_mtp = plan(), plan(ngram_table="mmap"), plan(mtp=True)
    model = load_model(path)
    # per QSA layer: K+V of 2 kv heads x 16, one 16-wide index key and a quarter of a block key (one per 4
    # tokens), fp32
    assert resident.kv_per_token == 2 * (2 * 16 * 2 + 16 + 16 // 4) * 4
    assert with_mtp.kv_per_token == 3 * (2 * 16 * 2 + 16 + 16 // 4) * 4 and with_mtp.drafter > 0
    states = [s for s in model.cache_spec().values() if isinstance(s, StateSpec)]
    assert len(states) == 4 and resident.state_per_request == sum(s.bytes_per_request() for s in states)
    table = ngram_table_bytes(path)
    ple_layers = [layer.ple for layer in model.model.layers if layer.ple is not None]
    assert table == sum(ple.ple_embedding.hasher.table_rows * 4 * 4 for ple in ple_layers)  # 4 dims, fp32
    assert resident.weights - mapped.weights == table
    assert resident.weights == sum(p.numel() * p.element_size() for p in model.parameters()) + table


def test_fp8_ngram_table_is_refused_not_misread(tmp_path):
    path = build_tiny_qwen4_exp(tmp_path, seed=26)
    name = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"
    _rewrite(path, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match="n-gram table is not supported"):
        load_model(path)


@torch.inference_mode()
def test_unpadded_ngram_table_loads_and_gives_the_same_logits(tmp_path):
    """The release stores 320,001,446 rows (the sum of its 16 primes, = our derivation), not transformers' padding
    to a multiple of 128: a table cut to the rows the hash can reach loads, in both modes, with equal logits."""
    from dgpp.plugin_api import EngineConfig
    from dgpp_qwen.layers.ngram import head_vocab_sizes

    assert sum(head_vocab_sizes(20_000_000, 0, 16)) == 320_001_446
    path = build_tiny_qwen4_exp(tmp_path, seed=29)
    model = load_model(path)
    prompts = conf.make_prompts(model.info.vocab_size, (9, 33), seed=30)
    before = conf.engine_all_logits(model, prompts)
    last = [
        layer.ple.ple_embedding.hasher.rows_needed for layer in model.model.layers if layer.ple is not None
    ]

    def cut(tensors):
        for layer, needed in zip((0, 2), last, strict=True):
            name = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_3.weight"
            tensors[name] = tensors[name][: needed - 3 * tensors[name].shape[0]].clone()

    _rewrite(path, cut)
    for engine in (None, EngineConfig(ngram_table="mmap")):
        after = conf.engine_all_logits(load_model(path, engine), prompts)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
