"""Tiny random checkpoints built with transformers' own classes and ``save_pretrained``, so the tensor
names, layouts and config.json are exactly what a release of that architecture has.

Weights are drawn from a seeded generator and every 1-D tensor (norms, biases, gates) is perturbed
away from its ones/zeros init, so a layer that ignores a norm weight or its ``(1 + w)`` form fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

# hidden 64, 4 q heads / 2 kv heads of 16, vocab 512: fast on 2 CPU cores, still GQA
TINY_TEXT: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.08,  # large enough that greedy picks are not near-ties
    "tie_word_embeddings": False,
}
TINY_MOE: dict[str, Any] = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
TINY_LINEAR_ATTN: dict[str, Any] = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_hidden_layers": 4,
}
TINY_VISION: dict[str, Any] = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}

# kind -> (transformers config class, model class, extra text keys, wrapped in a ConditionalGeneration)
KINDS: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, False),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**TINY_MOE, "norm_topk_prob": True}, False),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", TINY_LINEAR_ATTN, False),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**TINY_LINEAR_ATTN, **TINY_MOE, "shared_expert_intermediate_size": 32},
        False,
    ),
    "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", TINY_LINEAR_ATTN, True),
    "qwen3_5_moe_vl": (
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        {**TINY_LINEAR_ATTN, **TINY_MOE, "shared_expert_intermediate_size": 32},
        True,
    ),
}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.2)


@torch.no_grad()
def spread_tensors(named: Iterable[tuple[str, torch.Tensor]], gen: torch.Generator,
                   rules: dict[str, tuple[float, float]]) -> None:
    """Redraw each tensor whose name ends with a rule's suffix (the first that matches) as ``mean + std · x``, ``x``
    drawn from N(0, 1) in float64 by ``gen`` in iteration order and cast to the tensor's dtype before scaling: the
    families' builders move norms, sinks and biases off transformers' 1 / 0 inits with it."""
    for name, tensor in named:
        for suffix, (mean, std) in rules.items():
            if name.endswith(suffix):
                drawn = std * torch.randn(tensor.shape, generator=gen, dtype=torch.float64).to(tensor.dtype)
                tensor.copy_(mean + drawn if mean else drawn)
                break


def save_one_file(model: torch.nn.Module, out_dir: str | Path, kind: str) -> Path:
    """``model.save_pretrained(out_dir)``; a ``RuntimeError`` unless it wrote one ``model.safetensors`` (the tiny
    builders rewrite or extend that file)."""
    out = Path(out_dir)
    model.save_pretrained(out)
    if not (out / "model.safetensors").exists():
        raise RuntimeError(f"tiny {kind} checkpoint was sharded; expected one file at {out / 'model.safetensors'}")
    return out


def build_tiny_checkpoint(
    kind: str,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """Write a tiny random ``kind`` checkpoint (see ``KINDS``) to ``out_dir``; returns the directory.

    ``overrides`` are text-config keys (e.g. ``{"tie_word_embeddings": True}``); ``max_shard_size``
    (e.g. ``"40KB"``) forces a sharded checkpoint with a ``model.safetensors.index.json``.
    """
    import transformers

    if kind not in KINDS:
        raise ValueError(f"unknown tiny checkpoint kind {kind!r}; known: {', '.join(KINDS)}")
    config_cls, model_cls, extra, wrapped = KINDS[kind]
    text = {**TINY_TEXT, **extra, **(overrides or {})}
    if wrapped:
        tie = text.pop("tie_word_embeddings")
        config = getattr(transformers, config_cls)(text_config=text, vision_config=TINY_VISION, tie_word_embeddings=tie)
    else:
        config = getattr(transformers, config_cls)(**text)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _perturb(model, seed)
    model = model.to(dtype)
    out = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


def load_reference(checkpoint_dir: str | Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The transformers model for a checkpoint (its ``architectures[0]`` class), eval mode, eager attention."""
    import json

    import transformers

    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    cls = getattr(transformers, cfg["architectures"][0])
    kwargs: dict[str, Any] = {"attn_implementation": "eager"}
    if dtype is not None:
        kwargs["dtype"] = dtype
    return cls.from_pretrained(str(checkpoint_dir), **kwargs).eval()
