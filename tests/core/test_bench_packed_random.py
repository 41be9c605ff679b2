"""``dgpp bench``'s random packed weights (``dgpp.bench.packed_random``): in every format it draws, the stored codes
are valid (no NaN E4M3 code, every E2M1 nibble value present) and the decoded weights have the spread asked for,
in linears and in expert stacks alike; a format it cannot draw is refused by name."""

from __future__ import annotations

import pytest
import torch

from dgpp.bench.packed_random import fill_packed
from dgpp.nn.linear import Linear
from dgpp.quant.format import QuantFormat
from dgpp.quant.fp4 import MXFP4, FP4Grouped, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import GPTQ
from dgpp.quant.linear import QuantLinearMethod
from dgpp.quant.moe import QuantExperts

FORMATS = [
    FP8Block(block=(32, 32), scale_format="e8m0"),
    FP8Block(),
    MXFP4(),
    NVFP4ModelOpt(),
    NVFP4CompressedTensors(),
]
STD = 0.02


def _packed_linear(fmt: QuantFormat, out_features: int = 256, in_features: int = 512) -> Linear:
    layer = Linear(in_features, out_features, dtype=torch.float32)
    del layer.weight
    layer.quant_method = QuantLinearMethod(fmt)
    layer.quant_method.create_weights(layer, torch.float32)
    return layer


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{getattr(f, 'scale_format', '')}")
def test_a_packed_linear_decodes_to_the_asked_spread(fmt: QuantFormat) -> None:
    layer = _packed_linear(fmt)
    written = fill_packed(layer, STD, torch.Generator().manual_seed(0))
    tensors = {n: getattr(layer, n) for n in layer.quant_tensor_names}
    assert written == {id(t) for t in tensors.values()}
    weight = fmt.decode(tensors, (256, 512), torch.float32)
    assert weight.isfinite().all()
    assert 0.7 * STD < float(weight.std()) < 1.45 * STD and abs(float(weight.mean())) < 0.1 * STD
    if isinstance(fmt, FP4Grouped):  # E2M1 pairs: every one of the 16 codes in both nibbles
        data = tensors[fmt.data_name]
        assert torch.unique(data & 15).numel() == 16 and torch.unique(data >> 4).numel() == 16


def test_expert_stacks_are_drawn_per_projection() -> None:
    experts = QuantExperts(MXFP4(), 4, 64, 96)
    fill_packed(experts, STD, torch.Generator().manual_seed(1))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stack = getattr(experts, proj)
        for e in range(4):
            weight = stack.fmt.decode(stack.expert_tensors(e), stack.shape, torch.float32)
            assert 0.7 * STD < float(weight.std()) < 1.45 * STD


def test_a_format_without_a_random_form_is_refused_by_name() -> None:
    fmt = GPTQ()
    with pytest.raises(ValueError, match="gptq"):
        fill_packed(_packed_linear(fmt, 64, 128), STD, torch.Generator())
