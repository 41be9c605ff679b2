"""qwen4_exp config and checkpoint handling: the multimodal release layout (text under ``text_config`` and
``model.language_model.``) vs transformers, and one clear error, naming the key or tensor, for bad input."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from dgpp.engine.loading import load_model
from dgpp.errors import CheckpointError, ConfigError
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp.testing.qwen4_exp import TINY_QWEN4_EXP, build_tiny_qwen4_exp
from dgpp_qwen.qwen4_exp_config import parse_qwen4_exp_config


def test_wrapped_release_layout_matches_transformers(tmp_path):
    path = build_tiny_qwen4_exp(tmp_path, seed=21, wrapped=True)
    model, reference = load_model(path), load_reference(path)
    assert model.cfg.base.weight_prefix == "model.language_model."
    prompts = conf.make_prompts(model.info.vocab_size, (8, 33), seed=22)
    assert conf.check_logits(model, reference, prompts, rtol=1e-4) < 1e-4


def _text(**changes):
    return {"model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForCausalLM"], **TINY_QWEN4_EXP, **changes}


def test_parsed_fields():
    cfg = parse_qwen4_exp_config(_text())
    assert cfg.base.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.base.rope.rotary_dim == 8 and cfg.indexer.block_topk == 4 and cfg.hc_count == 4
    assert cfg.ngram.layer_ids == (0, 2) and cfg.ngram.num_heads == 16 and cfg.ngram.eos_token_id == 7
    # transformers' default for qwen4_exp is full-width RoPE when partial_rotary_factor is absent
    plain = parse_qwen4_exp_config(_text(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
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
        parse_qwen4_exp_config(_text(**changes))


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
