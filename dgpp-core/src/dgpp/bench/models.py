"""Random-weight models of real geometries, built straight in device memory, for benchmarks.

transformers builds the model from a config (its own random init), and dgpp's model is filled
from that model's state dict, so both run the very same weights. Nothing touches the disk.
"""

from __future__ import annotations

from typing import Any

import torch

from dgpp.engine.model import Model

# HF config.json fields of the geometries the benchmarks run (random weights; values from the
# published configs of the models named)
GEOMETRIES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "initializer_range": 0.08,
        "tie_word_embeddings": False,
    },
}


def hf_config(geometry: str, dtype: torch.dtype) -> dict[str, Any]:
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; known: {', '.join(GEOMETRIES)}")
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    return {**GEOMETRIES[geometry], "dtype": name, "torch_dtype": name}


@torch.inference_mode()
def build_pair(geometry: str, device: str, dtype: torch.dtype, seed: int = 0) -> tuple[Model, torch.nn.Module]:
    """(dgpp model, transformers model) sharing the same random weights, both on ``device``."""
    import transformers

    raw = hf_config(geometry, dtype)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(seed)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ours = build_model_like(raw, hf.state_dict(), device)
    return ours, hf


@torch.inference_mode()
def build_model_like(raw_config: dict[str, Any], state: dict[str, torch.Tensor], device: str) -> Model:
    """A dgpp Qwen3 model for ``raw_config`` whose parameters are copied from ``state`` (HF names)."""
    from dgpp_qwen.config import parse_config
    from dgpp_qwen.qwen3 import Qwen3ForCausalLM

    with torch.device(device):
        model = Qwen3ForCausalLM(parse_config(raw_config)).eval()
    for name, param in model.named_parameters():
        if name not in state:
            raise KeyError(f"benchmark weights have no tensor {name}")
        param.copy_(state[name])
    return model


@torch.inference_mode()
def build_random_model(geometry: str, device: str, dtype: torch.dtype, seed: int = 0) -> Model:
    """A dgpp model with N(0, 0.02) matrices and unit norms (no transformers model kept)."""
    from dgpp_qwen.config import parse_config
    from dgpp_qwen.qwen3 import Qwen3ForCausalLM

    raw = hf_config(geometry, dtype)
    std = float(raw.get("initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(parse_config(raw)).eval()
    for _, param in sorted(model.named_parameters()):
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32) * std)
    return model


def weight_bytes_per_step(model: Model) -> int:
    """Bytes of weights a decode step reads: every parameter once, except the embedding table (one
    row per token is read; a tied LM head still reads it whole, counted once)."""
    total = 0
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not tied:
            continue
        total += param.numel() * param.element_size()
    return total
