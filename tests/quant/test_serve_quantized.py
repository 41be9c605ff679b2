"""Tiny quantized Qwen checkpoints serve through the engine and match transformers run on the same
dequantized weights: FP8 block-scaled Qwen3 (block multiples and a ceil-grid block) and NVFP4 experts
in the Qwen3.5-MoE layout."""

from __future__ import annotations

import json

import pytest
import torch

from dgpp.quant.checkpoints import dequantize_checkpoint, quantize_checkpoint
from dgpp.quant.fp4 import NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.linear import QuantLinearMethod
from dgpp.quant.moe import QuantExperts
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint, load_reference

NVFP4_EXPERTS_ONLY = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "group_size": 16,
    "exclude_modules": ["lm_head", "*self_attn*", "*linear_attn*", "*shared_expert*", "*mlp.gate"],
}


def _serve_and_compare(quantized, tmp_path):
    dense = dequantize_checkpoint(quantized, tmp_path / "dense")
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    model, ref = load_model(quantized), load_reference(dense)
    prompts = conf.make_prompts(model.info.vocab_size, (7, 19), seed=1)
    worst = conf.check_logits(model, ref, prompts, rtol=1e-4)
    assert worst < 1e-4
    conf.check_greedy(model, ref, prompts, max_new_tokens=16)
    return model


@pytest.mark.parametrize("block", [(32, 32), (48, 48)], ids=["block32", "block48-ceil-grid"])
def test_fp8_block_qwen3_serves_like_transformers_on_dequantized(block, tmp_path):
    dense_src = build_tiny_checkpoint("qwen3", tmp_path / "src", seed=11)
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    quantized = quantize_checkpoint(dense_src, tmp_path / "fp8", config)
    model = _serve_and_compare(quantized, tmp_path)
    fp8_layers = [
        m for m in model.modules() if isinstance(getattr(m, "quant_method", None), QuantLinearMethod)
    ]
    assert len(fp8_layers) == 2 * 7  # q/k/v/o + gate/up/down in both layers
    assert all(
        isinstance(m.quant_method.fmt, FP8Block) and m.weight.dtype == torch.float8_e4m3fn for m in fp8_layers
    )


def test_nvfp4_experts_qwen3_5_moe_serve_like_transformers_on_dequantized(tmp_path):
    dense_src = build_tiny_checkpoint("qwen3_5_moe", tmp_path / "src", seed=12)
    quantized = quantize_checkpoint(dense_src, tmp_path / "nvfp4", NVFP4_EXPERTS_ONLY)
    model = _serve_and_compare(quantized, tmp_path)
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 4 and all(isinstance(e.fmt, NVFP4ModelOpt) for e in experts)
    assert not any(isinstance(getattr(m, "quant_method", None), QuantLinearMethod) for m in model.modules())
