"""Tiny random checkpoints built with transformers' own classes and ``save_pretrained``, so the tensor
names, layouts and config.json are exactly what a release of that architecture has. Which architectures there
are is the family plugins' knowledge: each offers its builders by name (``dgpp_tiny_checkpoints``), and
``build_tiny_checkpoint(kind)`` finds them through the plugin manager.

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


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.2)


@torch.no_grad()
def spread_tensors(
    named: Iterable[tuple[str, torch.Tensor]], gen: torch.Generator, rules: dict[str, tuple[float, float]]
) -> None:
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
        raise RuntimeError(
            f"tiny {kind} checkpoint was sharded; expected one file at {out / 'model.safetensors'}"
        )
    return out


def build_transformers_checkpoint(
    config_cls: str,
    model_cls: str,
    out_dir: str | Path,
    *,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """Write a tiny random checkpoint of transformers' ``model_cls`` (configured by ``config_cls``) to ``out_dir``.

    The text config is ``TINY_TEXT`` updated by ``text`` (the architecture's own keys), then by ``overrides``; with
    ``vision`` the model is a ConditionalGeneration whose text config and vision tower are given apart.
    ``max_shard_size`` (e.g. ``"40KB"``) forces a sharded checkpoint with a ``model.safetensors.index.json``.
    """
    import transformers

    text_config = {**TINY_TEXT, **(text or {}), **(overrides or {})}
    if vision is not None:
        tie = text_config.pop("tie_word_embeddings")
        config = getattr(transformers, config_cls)(
            text_config=text_config, vision_config=vision, tie_word_embeddings=tie
        )
    else:
        config = getattr(transformers, config_cls)(**text_config)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _perturb(model, seed)
    model = model.to(dtype)
    out = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


def build_tiny_checkpoint(kind: str, out_dir: str | Path, **options: Any) -> Path:
    """Write the tiny random checkpoint ``kind`` to ``out_dir``: the builder an installed family plugin offers under
    that name (``dgpp_tiny_checkpoints``), called with ``options`` (``seed``, ``dtype`` and the builder's own, e.g.
    ``overrides`` of text-config keys and ``max_shard_size`` for transformers-built kinds)."""
    from dgpp.catalog import tiny_checkpoint

    return tiny_checkpoint(kind).build(out_dir, **options)


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
