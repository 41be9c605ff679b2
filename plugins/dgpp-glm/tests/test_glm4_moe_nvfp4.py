"""GLM-4.7 as nvidia/GLM-4.7-NVFP4 ships it: ModelOpt NVFP4 MLP / expert / shared-expert projections
(``weight`` U8, ``weight_scale`` E4M3, ``weight_scale_2``, ``input_scale``), attention, head and the MTP
layer left dense. The tiny twin's dense weights are on the NVFP4 grid, so transformers on the dense
checkpoint is an exact reference for the packed one."""

from __future__ import annotations

import pytest
import torch
import transformers

from dgpp.family import LoadContext
from dgpp.nn.linear import UnquantizedLinearMethod
from dgpp.quant.linear import QuantLinearMethod
from dgpp.quant.moe import QuantExperts
from dgpp.startup.loading import load_model, read_hf_config
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_glm.draft import build_draft
from dgpp_glm.testing_glm4 import build_tiny_glm4_moe, nvfp4_twin

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    dense = build_tiny_glm4_moe(tmp_path_factory.mktemp("glm_grid"), seed=4, nvfp4_grid=True)
    packed = nvfp4_twin(dense, tmp_path_factory.mktemp("glm_nvfp4"), num_layers=3)
    return dense, packed, load_model(packed)


def test_packed_modules_are_the_ones_modelopt_quantizes(twins):
    _, _, model = twins
    dense_layer, moe_layer = model.model.layers[0], model.model.layers[1]
    assert isinstance(dense_layer.mlp.down_proj.quant_method, QuantLinearMethod)
    assert isinstance(moe_layer.mlp.experts, QuantExperts)
    assert isinstance(moe_layer.mlp.shared_expert.gate_proj.quant_method, QuantLinearMethod)
    assert isinstance(moe_layer.self_attn.q_proj.quant_method, UnquantizedLinearMethod)
    assert moe_layer.mlp.experts.gate_proj.weight.dtype == torch.uint8


def test_nvfp4_logits_and_greedy_match_transformers_on_dense_twin(twins):
    dense, _, model = twins
    ref = load_reference(dense)
    worst = conf.check_logits(
        model, ref, conf.make_prompts(model.info.vocab_size, (5, 18), seed=1), rtol=1e-4
    )
    assert worst < 1e-4
    conf.check_greedy(model, ref, conf.make_prompts(model.info.vocab_size, (9,), seed=2), max_new_tokens=16)


def test_mtp_layer_stays_dense_and_equals_dense_twin(twins):
    dense, packed, model = twins
    drafts = [
        build_draft(LoadContext(p, read_hf_config(p), "glm", "Glm4MoeForCausalLM"), m)
        for p, m in ((packed, model), (dense, load_model(dense)))
    ]
    assert isinstance(drafts[0].layers[0].mlp.experts.gate_up_proj, torch.nn.Parameter)  # not packed
    for name, param in drafts[0].state_dict().items():
        torch.testing.assert_close(param, drafts[1].state_dict()[name], rtol=0, atol=0, msg=name)


def test_dense_mtp_layer_loads_when_the_exclude_list_omits_it(twins, tmp_path):
    """Releases graft a BF16 MTP layer into an NVFP4 checkpoint without listing it in exclude_modules:
    the drafter goes by the tensors (no block scales -> dense), not by the list."""
    import json
    import shutil

    _, packed, model = twins
    grafted = tmp_path / "grafted"
    shutil.copytree(packed, grafted)
    cfg = json.loads((grafted / "config.json").read_text())
    cfg["quantization_config"]["exclude_modules"] = ["lm_head", "model.layers.*.self_attn*"]
    (grafted / "config.json").write_text(json.dumps(cfg))
    drafter = build_draft(LoadContext(grafted, cfg, "glm", "Glm4MoeForCausalLM"), model)
    assert isinstance(drafter.layers[0].eh_proj.quant_method, UnquantizedLinearMethod)
