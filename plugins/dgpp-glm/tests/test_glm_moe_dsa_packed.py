"""Full GLM-5.3 in its shipped weight form: compressed-tensors ``pack-quantized``, symmetric, group 64 —
int4 routed experts, int8 attention (MLA projections), shared experts and dense MLPs — served packed and
compared with transformers on the same checkpoint decoded to dense (``dequantize_checkpoint``)."""

from __future__ import annotations

import pytest
import torch
import transformers

from dgpp.nn.mla import MultiLatentAttention
from dgpp.quant.checkpoints import dequantize_checkpoint, quantize_checkpoint
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_glm.testing_glm5 import GLM5_PACKED_QUANTIZATION, build_tiny_glm_moe_dsa

transformers.logging.set_verbosity_error()


# every packed matrix needs its input width in whole groups of 64
GROUPED = {"q_lora_rank": 64, "kv_lora_rank": 64, "moe_intermediate_size": 64}


@pytest.fixture(scope="module")
def packed_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_moe_dsa_packed")
    dense = build_tiny_glm_moe_dsa(root / "dense", seed=2, **GROUPED)
    packed = quantize_checkpoint(dense, root / "packed", GLM5_PACKED_QUANTIZATION)
    decoded = dequantize_checkpoint(packed, root / "decoded")
    return load_model(packed), load_reference(decoded), packed


def test_each_module_takes_its_shipped_int_format(packed_pair):
    model, _, _ = packed_pair
    moe, dense_mlp, attn = (
        model.model.layers[1].mlp,
        model.model.layers[0].mlp,
        model.model.layers[0].self_attn,
    )
    for module, bits in ((attn.q_a_proj, 8), (dense_mlp.down_proj, 8)):
        assert module.quant_method.fmt.bits == bits and module.quant_method.fmt.group == 64
    assert moe.experts.fmt.bits == 4 and moe.experts.fmt.group == 64
    assert moe.shared_expert.down_proj.quant_method.fmt.bits == 8
    assert type(attn.indexer.wk.quant_method).__name__ == "UnquantizedLinearMethod"


def test_kv_b_is_kept_decoded_with_the_per_step_decode_bits(packed_pair, monkeypatch):
    """MLA's absorption reads the whole ``kv_b_proj`` matrix every step: the loaded model keeps the int8 form
    decoded once (``settle_weights``), and computes what decoding it every step computed, bit for bit."""
    model, _, packed = packed_pair
    monkeypatch.setattr(MultiLatentAttention, "settle_weights", lambda self: None)
    per_step = load_model(packed)
    for settled, unsettled in zip(model.model.layers, per_step.model.layers, strict=True):
        kept, shipped = settled.self_attn.kv_b_proj, unsettled.self_attn.kv_b_proj
        assert type(kept.quant_method).__name__ == "UnquantizedLinearMethod"
        assert shipped.quant_method.fmt.bits == 8 and shipped.quant_method.fmt.group == 64
        assert torch.equal(kept.weight, unsettled.self_attn.kv_b_weight())
    prompts = conf.make_prompts(model.info.vocab_size, (19, 5), seed=13)
    for ours, theirs in zip(
        conf.engine_all_logits(model, prompts), conf.engine_all_logits(per_step, prompts), strict=True
    ):
        assert torch.equal(ours, theirs)


def test_packed_logits_match_transformers_on_the_decoded_weights(packed_pair):
    model, ref, _ = packed_pair
    prompts = conf.make_prompts(model.info.vocab_size, (6, 27), seed=11)
    assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4


def test_packed_greedy_matches_transformers(packed_pair):
    model, ref, _ = packed_pair
    conf.check_greedy(model, ref, conf.make_prompts(model.info.vocab_size, (13,), seed=12), max_new_tokens=16)


def test_memory_plan_counts_kv_b_as_the_loaded_model_keeps_it(packed_pair, monkeypatch):
    """The plan, built on meta, counts ``kv_b_proj`` decoded, as the loaded model holds it."""
    from dgpp.plugins import build_manager
    from dgpp.startup.loading import load_context
    from dgpp.startup.memory_plan import plan_for

    def kv_b_bytes(m) -> int:
        return sum(
            p.numel() * p.element_size()
            for layer in m.model.layers
            for p in layer.self_attn.kv_b_proj.parameters()
        )

    model, _, packed = packed_pair
    settled = plan_for(build_manager(), load_context(packed)).weights
    monkeypatch.setattr(MultiLatentAttention, "settle_weights", lambda self: None)
    shipped = plan_for(build_manager(), load_context(packed)).weights
    assert settled - shipped == kv_b_bytes(model) - kv_b_bytes(load_model(packed)) > 0


def test_memory_plan_weights_are_the_loaded_models_bytes(packed_pair):
    """Built on meta, the plan counts every tensor as the loaded model holds it: the int formats' scales in their
    shipped 2 bytes (not the float32 placeholder's 4), ``kv_b_proj`` decoded."""
    from dgpp.plugins import build_manager
    from dgpp.quant.resident import resident_bytes
    from dgpp.startup.loading import load_context
    from dgpp.startup.memory_plan import plan_for

    model, _, packed = packed_pair
    assert plan_for(build_manager(), load_context(packed)).weights == resident_bytes(model)
