"""DeepSeek-V4.1-Flash's published config.json: the backbone's per-layer shape (every field but the layer roles,
the layer count, the Engram table sizes and the draft stages) and the quantization block, as the release ships
them. The benchmark geometry and the release-shape tests build their configs from these."""

from __future__ import annotations

from typing import Any

from dgpp_deepseek.release_layout import RELEASE_QUANTIZATION as V4_RELEASE_QUANTIZATION

RELEASE_TEXT_SHAPE: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "moe_intermediate_size": 2304,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
}
# DeepSeek-V4-Flash's FP8 (E8M0 scales) + MXFP4 experts, with 32 x 32 FP8 blocks instead of 128 x 128
RELEASE_QUANTIZATION: dict[str, Any] = {**V4_RELEASE_QUANTIZATION, "weight_block_size": [32, 32]}
