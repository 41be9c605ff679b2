"""Full GLM-5.3 in its shipped weight form: compressed-tensors ``pack-quantized``, symmetric, group 64 —
int4 routed experts, int8 attention (MLA projections), shared experts and dense MLPs — served packed and
compared with transformers on the same checkpoint decoded to dense (``dequantize_checkpoint``)."""

from __future__ import annotations

import pytest
import transformers

from dgpp.engine.loading import load_model
from dgpp.quant.checkpoints import dequantize_checkpoint, quantize_checkpoint
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp.testing.glm_moe_dsa import GLM5_PACKED_QUANTIZATION, build_tiny_glm_moe_dsa

transformers.logging.set_verbosity_error()


# every packed matrix needs its input width in whole groups of 64
GROUPED = {"q_lora_rank": 64, "kv_lora_rank": 64, "moe_intermediate_size": 64}


@pytest.fixture(scope="module")
def packed_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_moe_dsa_packed")
    dense = build_tiny_glm_moe_dsa(root / "dense", seed=2, **GROUPED)
    packed = quantize_checkpoint(dense, root / "packed", GLM5_PACKED_QUANTIZATION)
    decoded = dequantize_checkpoint(packed, root / "decoded")
    return load_model(packed), load_reference(decoded)


def test_each_module_takes_its_shipped_int_format(packed_pair):
    model, _ = packed_pair
    moe, dense_mlp, attn = (
        model.model.layers[1].mlp,
        model.model.layers[0].mlp,
        model.model.layers[0].self_attn,
    )
    for module, bits in ((attn.kv_b_proj, 8), (attn.q_a_proj, 8), (dense_mlp.down_proj, 8)):
        assert module.quant_method.fmt.bits == bits and module.quant_method.fmt.group == 64
    assert moe.experts.fmt.bits == 4 and moe.experts.fmt.group == 64
    assert moe.shared_expert.down_proj.quant_method.fmt.bits == 8
    assert type(attn.indexer.wk.quant_method).__name__ == "UnquantizedLinearMethod"


def test_packed_logits_match_transformers_on_the_decoded_weights(packed_pair):
    model, ref = packed_pair
    prompts = conf.make_prompts(model.info.vocab_size, (6, 27), seed=11)
    assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4


def test_packed_greedy_matches_transformers(packed_pair):
    model, ref = packed_pair
    conf.check_greedy(model, ref, conf.make_prompts(model.info.vocab_size, (13,), seed=12), max_new_tokens=16)
