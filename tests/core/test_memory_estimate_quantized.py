"""The generic memory plan counts a quantized checkpoint's linears at their packed size, not dequantized."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from dgpp.config import parse_config
from dgpp.quant import module_weight_bytes
from dgpp.quant.checkpoints import quantize_checkpoint
from dgpp.quant.scheme import QuantScheme
from dgpp.startup.memory_estimate import estimate_memory_plan
from dgpp.testing.builders import build_tiny_checkpoint

QUANTIZED_LAYERS = r".*\.layers\.\d+\..*"  # quantize_checkpoint's default: linears inside the decoder layers
CONFIGS = {
    "fp8_block": {"quant_method": "fp8", "weight_block_size": [32, 32]},
    "nvfp4_modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
}


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("dense"), dtype=torch.bfloat16)


@pytest.mark.parametrize("name", CONFIGS)
def test_quantized_weights_are_counted_packed(name, dense_checkpoint, tmp_path):
    engine = parse_config({"model": "m"}).engine
    dense_plan = estimate_memory_plan(
        dense_checkpoint, json.loads((dense_checkpoint / "config.json").read_text()), engine
    )
    quantized = quantize_checkpoint(dense_checkpoint, tmp_path / name, CONFIGS[name])
    hf = json.loads((quantized / "config.json").read_text())
    scheme = QuantScheme.from_hf_config(hf)
    # what the resident weights cost: packed bytes (quant.module_weight_bytes) per quantized linear, bf16 otherwise
    want = packed_linears = 0
    with safe_open(str(dense_checkpoint / "model.safetensors"), "pt") as f:
        for tensor in f.keys():
            shape = tuple(f.get_slice(tensor).get_shape())
            module = tensor.removesuffix(".weight")
            if tensor.endswith(".weight") and len(shape) == 2 and re.fullmatch(QUANTIZED_LAYERS, module):
                assert scheme.format_for(module).name == name
                want += module_weight_bytes(scheme, module, shape, 2)
                packed_linears += 1
            else:
                want += 2 * shape[0] * (shape[1] if len(shape) == 2 else 1)
    assert packed_linears == 2 * 7  # q, k, v, o, gate, up, down in each of the two layers
    plan = estimate_memory_plan(quantized, hf, engine)
    assert plan.weights == want
    # dequantized (bf16) linears would cost the dense plan; packed ones cost well under it
    assert plan.weights < dense_plan.weights - packed_linears * 64 * 32
    assert estimate_memory_plan(quantized, hf, engine, world_size=2).weights == -(-want // 2)
