"""A tiny random DFlash2 drafter checkpoint (``DFlash2DraftModel``) for a tiny Qwen3.5 target, in the tensor names
and shapes z-lab's DFlash2 releases use: Qwen3 layers with ``attention_conv`` / ``mlp_conv``, ``fc``,
``hidden_norm``, ``norm`` and the ``candidate_selector``; no embedding and no head (the target's are shared)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def build_tiny_dflash2(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    layers: int = 2,
    block_size: int = 5,
    target_layer_ids: tuple[int, ...] = (1, 3),
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 96,
    group_size: int = 8,
    rank: int = 8,
    top_k: int = 6,
    sliding_window: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a random drafter for the target at ``target_dir``."""
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config", target)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return (mean + std * torch.randn(shape, generator=gen)).to(dtype)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return randn(rows, cols, std=cols**-0.5)

    q, kv, groups = heads * head_dim, kv_heads * head_dim, hidden // group_size
    t: dict[str, torch.Tensor] = {}
    for n in range(layers):
        p = f"layers.{n}."
        t[p + "input_layernorm.weight"] = randn(hidden, std=0.2, mean=1.0)
        t[p + "post_attention_layernorm.weight"] = randn(hidden, std=0.2, mean=1.0)
        t[p + "self_attn.q_proj.weight"] = matrix(q, hidden)
        t[p + "self_attn.k_proj.weight"] = matrix(kv, hidden)
        t[p + "self_attn.v_proj.weight"] = matrix(kv, hidden)
        t[p + "self_attn.o_proj.weight"] = matrix(hidden, q)
        t[p + "self_attn.q_norm.weight"] = randn(head_dim, std=0.2, mean=1.0)
        t[p + "self_attn.k_norm.weight"] = randn(head_dim, std=0.2, mean=1.0)
        t[p + "mlp.gate_proj.weight"] = matrix(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = matrix(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = matrix(hidden, intermediate)
        for conv in ("attention_conv", "mlp_conv"):
            t[f"{p}{conv}.base_kernel"] = randn(2, 2, hidden, std=0.3, mean=0.5)
            t[f"{p}{conv}.kernel_projection.weight"] = matrix(2 * 2 * groups, hidden) * 0.3
    t["fc.weight"] = matrix(hidden, len(target_layer_ids) * hidden)
    t["hidden_norm.weight"] = randn(hidden, std=0.2, mean=1.0)
    t["norm.weight"] = randn(hidden, std=0.2, mean=1.0)
    t["candidate_selector.predecessor_codebook"] = randn(vocab, rank)
    t["candidate_selector.successor_codebook"] = randn(vocab, rank)
    t["candidate_selector.hidden_projection.weight"] = matrix(rank, hidden)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "dtype": str(dtype).removeprefix("torch."),
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": target.get("max_position_embeddings", 512),
        "use_sliding_window": True,
        "sliding_window": sliding_window,
        "tie_word_embeddings": False,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": vocab - 1,
            "target_layer_ids": list(target_layer_ids),
            "conv_kernel_size": 2,
            "conv_group_size": group_size,
            "selector_rank": rank,
            "selector_top_k": top_k,
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
