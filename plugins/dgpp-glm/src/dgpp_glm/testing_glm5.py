"""Tiny random ``glm_moe_dsa`` (full GLM-5.3) checkpoints, built and saved by transformers' own classes.

Small enough for a CPU test run, big enough that every GLM-5.3 feature runs: one dense layer then MoE
layers, indexer layers ``full, shared, full, shared`` (``index_topk_freq`` 2, ``index_skip_topk_offset``
1, read by transformers' config), an ``index_topk`` of 8 (below the test prompts, so the sparse path is
live) and 16 indexer heads: with few heads, ReLU-zero index scores tie at the top-k cut often enough that
transformers' cached and uncached forwards pick different tokens (its ``torch.topk`` leaves tie order open).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dgpp_glm.testing_glm4 import TINY_GLM_MOE, _spread_weights, declare_mtp

TINY_GLM_MOE_DSA: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 8,
    "index_topk_freq": 2,
    "index_skip_topk_offset": 1,
    **TINY_GLM_MOE,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.08,
    "eos_token_id": [1, 2],
    "bos_token_id": None,
    # no padding_idx: its all-zero embedding row gives a query of zeros, so every index score of that row
    # ties at 0 and transformers' pick among them is unspecified
    "pad_token_id": None,
}


def tiny_glm_moe_dsa_config(**overrides: Any) -> dict[str, Any]:
    cfg = dict(TINY_GLM_MOE_DSA)
    cfg.update(overrides)
    return cfg


def build_tiny_glm_moe_dsa(
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    mtp_layers: int = 0,
    mtp_own_head: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random ``GlmMoeDsaForCausalLM`` checkpoint (config.json + model.safetensors) to ``out_dir``.
    Norms, biases (the indexer's LayerNorm included) and the router's correction bias are moved off their
    initial 1 / 0, so a loader that drops one changes the logits.

    ``mtp_layers`` = M > 0 adds M MTP layers at ``model.layers.{num_hidden_layers + i}`` as the release stores
    them: transformers builds them as trailing MoE decoder blocks (so their tensors carry the release's names; an
    indexer where the freq / offset schedule makes the index ``full``), plus the MTP-only tensors
    (``mtp_own_head``: their own embedding and head copies); config.json then declares
    ``num_nextn_predict_layers`` = M over the original stack."""
    from safetensors.torch import load_file
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = tiny_glm_moe_dsa_config(**overrides)
    layers = cfg["num_hidden_layers"]
    torch.manual_seed(seed)
    config = GlmMoeDsaConfig(
        **{**cfg, "num_hidden_layers": layers + mtp_layers}, dtype=str(dtype).removeprefix("torch.")
    )
    model = GlmMoeDsaForCausalLM(config).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    _spread_weights(model, gen)
    out = Path(out_dir)
    model.save_pretrained(out)
    if mtp_layers:
        declare_mtp(
            out, load_file(out / "model.safetensors"), cfg, layers, mtp_layers, dtype, gen, mtp_own_head
        )
    return out


def _int_group(bits: int, targets: list[str]) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}
    return {"targets": targets, "weights": weights, "format": "pack-quantized"}


# The quantization_config form of the GLM-5.3 int4/int8 release as its model card describes it: compressed-tensors
# pack-quantized, symmetric, group 64; int4 routed experts, int8 attention, shared experts and dense MLPs; router,
# indexer, embedding and head dense. (The release's exact ignore list was not available to check.)
GLM5_PACKED_QUANTIZATION: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "ignore": ["lm_head", r"re:.*\.indexer\..*", r"re:.*\.mlp\.gate$"],
    "config_groups": {
        "routed_experts": _int_group(4, [r"re:.*\.mlp\.experts\.\d+\.(gate|up|down)_proj$"]),
        "attention_and_shared": _int_group(
            8, [r"re:.*\.self_attn\..*", r"re:.*\.mlp\.(shared_experts\.)?(gate|up|down)_proj$"]
        ),
    },
}

# Full GLM-5.3 (glm_moe_dsa) per layer: hidden 6144, MLA 64 heads (q_lora 2048, kv_lora 512, nope 192 + rope 64,
# v 256), DSA indexer 32 x 128 top-2048 on the freq-4 / offset-3 schedule, 256 experts top-8 of 2048 + 1 shared;
# the int4 (routed experts) / int8 (attention, shared, dense MLP) group-64 release form. 78 layers do not fit one
# H200 even packed (~5 GB per MoE layer): the benchmark keeps the first GLM5_LAYERS (3 dense + 9 MoE, the indexer
# running on layers 0, 1, 2, 6 and 10 and the others reusing its selection, as in the release)
GLM5_LAYERS = 12
GLM5_BENCH: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "architectures": ["GlmMoeDsaForCausalLM"],
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": GLM5_LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0},
    "max_position_embeddings": 1048576,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "quantization_config": GLM5_PACKED_QUANTIZATION,
}
