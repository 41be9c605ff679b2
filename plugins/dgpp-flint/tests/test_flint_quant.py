"""Flint's routed experts as the export ships them: FP8 block-128 layers, NVFP4 layers and layers that mix the
two across gate_proj / up_proj / down_proj, resolved per projection from ``quantization_config``. The packed
checkpoint computes exactly what its dequantized twin computes (same weights, dense)."""

from __future__ import annotations

import pytest
import torch

from dgpp.errors import ConfigError
from dgpp.offline import greedy_generate
from dgpp.quant.apply import quantize_modules
from dgpp.quant.moe import QuantExperts
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp_flint.testing import MIXED_EXPERT_FORMATS, build_tiny_flint, mixed_expert_twins, quantization_config


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    root = tmp_path_factory.mktemp("flint_mixed")
    dense, packed = mixed_expert_twins(build_tiny_flint(root / "dense", seed=11), root / "packed")
    return load_model(dense), load_model(packed)


def test_each_projection_gets_its_own_format(twins):
    _, packed = twins
    names = {"fp8": "fp8_block", "nvfp4": "nvfp4_ct"}
    for layer, per_proj in MIXED_EXPERT_FORMATS.items():
        experts = packed.model.layers[layer].mlp.experts
        assert isinstance(experts, QuantExperts)
        assert {p: f.name for p, f in experts.formats.items()} == {p: names[k] for p, k in per_proj.items()}
    # shared expert, dense MLPs and attention stay dense
    assert packed.model.layers[2].mlp.shared_expert.down_proj.weight.dtype == torch.float32


def test_packed_logits_and_tokens_equal_the_dequantized_twin(twins):
    dense, packed = twins
    prompts = conf.make_prompts(dense.info.vocab_size, (6, 21), seed=12)
    for ours, theirs in zip(
        conf.engine_all_logits(packed, prompts), conf.engine_all_logits(dense, prompts), strict=True
    ):
        assert torch.equal(ours, theirs)  # decoded weights are exact, and the CPU products are the same
    assert greedy_generate(packed, prompts, 16) == greedy_generate(dense, prompts, 16)


def test_packed_chunked_and_batched_rows_are_bit_identical(twins):
    _, packed = twins
    prompts = conf.make_prompts(packed.info.vocab_size, (5, 19), seed=13)
    conf.check_batch_invariance(packed, prompts)
    conf.check_chunk_invariance(packed, prompts, chunk_sizes=(3,))


def test_a_projection_mixed_across_experts_is_refused_by_name():
    from dgpp_flint.config import FlintArchConfig
    from dgpp_flint.model import FlintForCausalLM
    from dgpp_flint.testing import tiny_flint_config

    cfg = tiny_flint_config()
    qc = quantization_config({2: {"gate_proj": "fp8", "up_proj": "fp8", "down_proj": "fp8"}})
    qc["config_groups"]["group_0"]["targets"] = [r"re:model\.layers\.2\.mlp\.experts\.0\..*"]  # expert 0 only
    with torch.device("meta"):
        model = FlintForCausalLM(FlintArchConfig.from_hf_config(cfg))
        with pytest.raises(ConfigError, match="model.layers.2.mlp.experts"):
            quantize_modules(model, {**cfg, "quantization_config": qc})
