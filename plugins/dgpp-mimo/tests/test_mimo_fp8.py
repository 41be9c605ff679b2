"""MiMo-V2-Flash in the FP8 block layout (``quant_method: fp8``, E4M3 weights with a ``weight_scale_inv`` per block,
dense projections and routed experts alike; routers, norms, sinks, embedding and head unquantized, and o_proj
left dense through ``modules_to_not_convert`` as MiMo-V2.6 keeps it): the packed checkpoint loads as shipped and
its logits equal transformers' on the dequantized twin within 1e-4 (fp32). Blocks of 32 here (128 in releases)
so the tiny projections hold several blocks each."""

from __future__ import annotations

import pytest
import transformers

from dgpp.quant.checkpoints import dequantize_checkpoint, quantize_checkpoint
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.moe import QuantExperts
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_mimo.testing import build_tiny_mimo

transformers.logging.set_verbosity_error()
FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "modules_to_not_convert": ["mlp.gate", "o_proj"],
}


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_fp8")
    packed = quantize_checkpoint(build_tiny_mimo(root / "src", seed=3), root / "fp8", FP8)
    return packed, dequantize_checkpoint(packed, root / "dequantized")


def test_fp8_checkpoint_loads_as_shipped_and_matches_transformers(twins):
    packed, dense = twins
    model = load_model(packed)
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn.q_proj.quant_method.fmt, FP8Block) and isinstance(
        layer.mlp.experts, QuantExperts
    )
    assert not hasattr(layer.self_attn.o_proj.quant_method, "fmt")  # kept dense, as listed
    prompts = conf.make_prompts(model.info.vocab_size, (5, 23), seed=4)
    conf.check_logits(model, load_reference(dense), prompts, rtol=1e-4)
    conf.check_greedy(model, load_reference(dense), prompts[:1], max_new_tokens=16)
