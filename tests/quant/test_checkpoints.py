"""quantize_checkpoint / dequantize_checkpoint: release layouts in, the engine's decoded values out."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dgpp.quant.checkpoints import dequantize_checkpoint, quantize_checkpoint
from dgpp.quant.encode import encode
from dgpp.quant.scheme import QuantScheme

CONFIGS = {
    "fp8-ue8m0": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"},
    "ct-nvfp4": {
        "quant_method": "compressed-tensors",
        "ignore": ["lm_head"],
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "format": "nvfp4-pack-quantized",
                "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
            }
        },
    },
    "ct-int8": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 64},
            }
        },
    },
    "gptq-int4": {"quant_method": "gptq", "bits": 4, "group_size": 64},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_dequantized_checkpoint_holds_the_decoded_values(name, tmp_path):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 128, generator=gen) * 0.1
    src = tmp_path / "src"
    src.mkdir()
    save_file(
        {"model.layers.0.mlp.down_proj.weight": weight, "lm_head.weight": torch.randn(32, 64)},
        str(src / "model.safetensors"),
    )
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    quantized = quantize_checkpoint(src, tmp_path / "q", CONFIGS[name])
    fmt = QuantScheme.from_hf_config(json.loads((quantized / "config.json").read_text())).format_for(
        "model.layers.0.mlp.down_proj"
    )
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.down_proj.weight" not in names or fmt.name.startswith("fp8")
    assert "lm_head.weight" in names  # outside the layers: left dense
    dense = dequantize_checkpoint(quantized, tmp_path / "d")
    with safe_open(str(dense / "model.safetensors"), "pt") as f:
        got = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        assert not any(n.endswith(("_scale", "_scale_inv", "qzeros", "_packed")) for n in f.keys())
    want = fmt.decode(encode(fmt, weight), (64, 128), torch.float32)
    assert torch.equal(got, want)
    assert (want - weight).abs().max() < 0.25 * weight.abs().max()
