"""Tiny random ``deepseek_v4`` checkpoints in the release's tensor names (``embed.weight``, ``layers.N.attn.wq_a``,
``layers.N.hc_attn_fn``, ``layers.N.ffn.experts.E.w1``, ``hc_head_fn``, ``head.weight``: no ``model.`` prefix),
which transformers loads through its conversion mapping.

The default shape has every layer kind (sliding, HCA, CSA twice), a window, compression ratios and ``index_topk``
smaller than the test prompts, 16 indexer heads, and two hash layers whose ``tid2eid`` gives every token distinct
experts. Parameters transformers initializes to constants (sinks, ``ape``, hyper-connection bases and scales,
the correction bias, norms) are drawn at random so that dropping any of them moves the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dgpp.testing.builders import save_one_file

TINY_DEEPSEEK_V4: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 128,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "layer_types": [
        "sliding_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "sliding_window": 6,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 3,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
    "bos_token_id": 0,
}


def tiny_deepseek_v4_config(**overrides: Any) -> dict[str, Any]:
    cfg = dict(TINY_DEEPSEEK_V4)
    cfg.update(overrides)
    return cfg


@torch.no_grad()
def _spread_weights(model: torch.nn.Module, gen: torch.Generator, num_experts: int) -> None:
    def randn(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(randn(p.shape, 0.2, 1.0))
        elif name.endswith(".sinks"):
            p.copy_(randn(p.shape, 1.5))
        elif name.endswith("position_bias"):
            p.copy_(randn(p.shape, 0.5))
        elif name.endswith(("hc.base", "hc_head.hc_base")):
            p.copy_(randn(p.shape, 0.5))
        elif name.endswith(("hc.scale", "hc_head.hc_scale")):
            p.copy_(randn(p.shape, 0.3, 1.0))
        elif name.endswith(("hc.fn", "hc_head.hc_fn")):
            p.copy_(randn(p.shape, 0.3))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(randn(b.shape, 0.3))
        elif name.endswith("tid2eid"):  # distinct experts per token, as the release's table has
            b.copy_(
                torch.stack(
                    [torch.randperm(num_experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]
                )
            )


def _release_name(hf_saved: str) -> str:
    """transformers' saved name -> the release's (what its conversion mapping reads back)."""
    name = hf_saved.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name.startswith("hc_head.hc_"):
        return "hc_head_" + name.removeprefix("hc_head.hc_")
    return name


def build_tiny_deepseek_v4(
    out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Write a random ``DeepseekV4ForCausalLM`` checkpoint (config.json + model.safetensors) to ``out_dir``."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    out = Path(out_dir)
    cfg = tiny_deepseek_v4_config(**overrides)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kwargs, dtype=str(dtype).removeprefix("torch."))).to(
        dtype
    )
    _spread_weights(model.eval(), torch.Generator().manual_seed(seed + 1), cfg["n_routed_experts"])
    path = save_one_file(model, out, "deepseek_v4") / "model.safetensors"
    tensors = load_file(path)
    save_file({_release_name(k): v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    return out
