"""Tiny random ``deepseek_v41`` checkpoints in the release's tensor names (``embed.weight``,
``layers.N.attn.wq_a.weight``, ``layers.N.hc_attn_fn``, ``layers.N.attn.indexer.wk.weight``,
``layers.N.engram.embed.weight`` + ``.scale``, ``head.weight``), with the tiny tokenizer the Engram classes come
from.

The default shape has every CSA2 role: window-only layers, a ratio-2 group (kv source 1, reindex at 3, reuse
at 2) and a ratio-1 group (kv source and candidate source 4, reindex at 6, reuse at 5 and 7), candidate blocks
of 2 entries of which 3 are kept, ``index_topk`` 4, a window of 6, and Engram on layers 1 and 4 (2- and
3-grams, 2 heads each, the table FP8 E4M3 with E8M0 scales) -- all below the test prompts' lengths. Norms,
sinks, hyper-connection parameters and the correction bias are random so that dropping any moves the logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dgpp.testing.tokenizers import build_tiny_tokenizer

TINY_DEEPSEEK_V41_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 6,
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1],
    "kv_source_layer_ids": [1, 4],
    "index_source_layer_ids": [1, 3, 4, 6],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 2,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 512,
    "engram_layer_ids": [1, 4],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 37,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def tiny_deepseek_v41_config(dtype: torch.dtype = torch.float32, **text_overrides: Any) -> dict[str, Any]:
    """The root config.json (``text_config`` nested); the Engram sizes are filled in by the builder."""
    text = {**TINY_DEEPSEEK_V41_TEXT, **text_overrides}
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "torch_dtype": str(dtype).removeprefix("torch."),
        "text_config": text,
        "tie_word_embeddings": False,
    }


def _random_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    def randn(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            value = randn(p.shape, 0.2, 1.0)
        elif name.endswith("attn_sink"):
            value = randn(p.shape, 1.5)
        elif name.endswith(("hc.base", "hc.scale")):
            value = randn(p.shape, 0.5, 0.5 if name.endswith("scale") else 0.0)
        elif name.endswith("hc.fn"):
            value = randn(p.shape, 0.3)
        elif name.endswith(("q_weight", "k_weight")):
            value = randn(p.shape, 0.5, 1.0)
        else:
            value = randn(p.shape, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.3)
        with torch.no_grad():
            p.copy_(value.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                b.copy_(randn(b.shape, 0.3).to(b.dtype))


def _fp8_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as E4M3 codes with an E8M0 exponent per 32 channels."""
    blocks = values.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    exponent = torch.ceil(torch.log2(amax / 448.0)).to(torch.int32)
    codes = (blocks / torch.exp2(exponent.float())[..., None]).to(torch.float8_e4m3fn).flatten(-2)
    return codes, (exponent + 127).to(torch.uint8)


def build_tiny_deepseek_v41(
    out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **text_overrides: Any
) -> Path:
    """Write a random ``DeepseekV41ForCausalLM`` checkpoint (config.json, model.safetensors, tokenizer) to
    ``out_dir``."""
    from safetensors.torch import save_file

    from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
    from dgpp_deepseek.v41_engram import bucket_primes, token_classes
    from dgpp_deepseek.v41_loader import checkpoint_name
    from dgpp_deepseek.v41_model import DeepseekV41ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(out)
    classes = token_classes(out / "tokenizer.json")
    root = tiny_deepseek_v41_config(dtype, **text_overrides)
    text = root["text_config"]
    text["vocab_size"] = len(classes)  # every id the tokenizer has
    text["engram_compressed_vocab_size"] = max(classes) + 1
    text["engram_num_embeddings"] = [0] * len(text.get("engram_layer_ids", []))
    cfg = DeepseekV41ArchConfig.from_hf_config(root)
    text["engram_num_embeddings"] = [sum(sum(p) for p in layer) for layer in bucket_primes(cfg)]
    cfg = DeepseekV41ArchConfig.from_hf_config(root)
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(cfg, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    _random_weights(model, gen)
    tensors: dict[str, torch.Tensor] = {}
    buffers = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, t in [*model.named_parameters(), *buffers]:
        tensors[checkpoint_name(name)] = t.detach().contiguous()
    for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings, strict=True):
        table = torch.randn(rows, cfg.engram_head_dim, generator=gen)
        codes, scales = _fp8_rows(table)
        tensors[f"layers.{layer}.engram.embed.weight"] = codes
        tensors[f"layers.{layer}.engram.embed.scale"] = scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(root, indent=2))
    return out
