"""Tiny random ``glm5_next`` (GLM-5.3-Flash) checkpoints, built and saved by transformers' own classes.

``Glm5NextForConditionalGeneration`` with a one-block vision tower (its tensors are in the file, as in the release)
and a text model small enough for a CPU test run in which every feature runs: KDA layers
0 and 3, indexed MLA layers 1, 2 and 4 (layer 2 reusing layer 1's selection), one dense MLP layer then MoE,
mHC with 4 streams. ``index_kpool`` 4 as in the release (transformers' default is 16) and ``index_topk`` 8 (two
pools): prompts of 12 tokens and more run the sparse path. 16 indexer heads: with few heads, ReLU-zero pool
scores tie at the top-k cut often enough that transformers' unpinned ``torch.topk`` picks differ from run to run.
``swiglu_limit`` 1.0 so the clamps bind at these weight scales (the release's 10 is never reached here).
``build_tiny_glm5_next_vl`` adds what reading images takes: the image markers in the tokenizer and config.json, a
two-block tower and a ``preprocessor_config.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dgpp.testing.builders import save_one_file, spread_tensors
from dgpp_glm.testing_glm4 import _spread_weights

TINY_GLM5_NEXT_TEXT: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "layer_types": [
        "linear_attention",
        "indexed_attention",
        "indexed_attention",
        "linear_attention",
        "indexed_attention",
    ],
    "indexer_types": ["full", "full", "shared", "full", "full"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 0,
    "v_head_dim": 16,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 8,
    "index_kpool": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "hc_mult": 4,
    "swiglu_limit": 1.0,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "initializer_range": 0.08,
    "eos_token_id": [1, 2],
    "bos_token_id": None,
    # the release's pad id is past this vocabulary; padding is told by the attention mask
    "pad_token_id": None,
}

TINY_GLM5_NEXT_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "projection_intermediate_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


# a two-block tower whose clamps bind (swiglu_limit 1.0) for the image tests
TINY_GLM5_NEXT_VL_VISION: dict[str, Any] = {
    **TINY_GLM5_NEXT_VISION,
    "depth": 2,
    "swiglu_limit": 1.0,
    "initializer_range": 0.1,
}
# the image markers, added to the tiny chat tokenizer (their ids are read back from it)
IMAGE_MARKERS = {
    "image_start_token_id": "<|begin_of_image|>",
    "image_end_token_id": "<|end_of_image|>",
    "image_token_id": "<|image|>",
    "video_start_token_id": "<|begin_of_video|>",
    "video_end_token_id": "<|end_of_video|>",
    "video_token_id": "<|video|>",
}
# GLM5-Next image processor settings for that tower: canvases of 4 .. 36 tokens (28-pixel merge blocks)
TINY_GLM5_NEXT_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Glm5NextImageProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "patch_expand_factor": 1,
    "min_image_tokens": 4,
    "max_image_tokens": 36,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def tiny_glm5_next_text_config(**overrides: Any) -> dict[str, Any]:
    cfg = dict(TINY_GLM5_NEXT_TEXT)
    cfg.update(overrides)
    return cfg


@torch.no_grad()
def build_tiny_glm5_next(
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vision: dict[str, Any] | None = None,
    token_ids: dict[str, int] | None = None,
    **overrides: Any,
) -> Path:
    """Write a random ``Glm5NextForConditionalGeneration`` checkpoint (config.json + model.safetensors) to
    ``out_dir``; ``overrides`` update the text config, ``vision`` replaces the one-block tower's config,
    ``token_ids`` sets config.json's image and video marker ids. Norms, biases, the router's correction bias, the KDA decay
    parameters, the mHC biases and scales and the indexer's pooling gate and position table are moved off their
    initial values, so a loader that drops one changes the logits."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    config = Glm5NextConfig(
        text_config=tiny_glm5_next_text_config(**overrides),
        vision_config=vision or TINY_GLM5_NEXT_VISION,
        tie_word_embeddings=False,
        **(token_ids or {}),
        dtype=str(dtype).removeprefix("torch."),
    )
    model = Glm5NextForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    _spread_weights(model, gen)
    rules = {
        "A_log": (0.0, 0.5),
        "dt_bias": (0.0, 0.5),
        "hc.base": (0.0, 0.5),
        "hc.scale": (1.0, 0.3),
        "index_kpool_compress_ape": (0.0, 1.0),
        "index_kpool_compress_gate": (0.0, 0.3),
    }
    spread_tensors(model.named_parameters(), gen, rules)
    return save_one_file(model.to(dtype), out_dir, "glm5_next")


def build_tiny_glm5_next_vl(
    out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """A tiny ``glm5_next`` that reads images: the tiny chat tokenizer plus the image markers
    (``IMAGE_MARKERS``, their ids written to config.json), the two-block tower ``TINY_GLM5_NEXT_VL_VISION`` and a
    GLM5-Next ``preprocessor_config.json`` (``TINY_GLM5_NEXT_PREPROCESSOR``)."""
    import json

    from tokenizers import AddedToken, Tokenizer

    from dgpp.testing.tokenizers import build_tiny_tokenizer

    out = build_tiny_tokenizer(out_dir)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in IMAGE_MARKERS.values()])
    tok.save(str(out / "tokenizer.json"))
    found = {key: tok.token_to_id(text) for key, text in IMAGE_MARKERS.items()}
    ids = {key: i for key, i in found.items() if i is not None and i < TINY_GLM5_NEXT_TEXT["vocab_size"]}
    if ids != found:
        raise AssertionError(f"the tiny tokenizer's image markers {found} are not all in the tiny vocabulary")
    build_tiny_glm5_next(
        out, seed=seed, dtype=dtype, vision=TINY_GLM5_NEXT_VL_VISION, token_ids=ids, **overrides
    )
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_GLM5_NEXT_PREPROCESSOR))
    return out


# GLM-5.3-Flash per layer: hidden 4096; KDA 64 heads x 128 with a 4-tap conv on layers i % 4 != 3, NoPE MLA 64 heads
# (q_lora 1536, kv_lora 512, nope 256, v 256) with the k-pooled indexer (32 x 128, kpool 4, top-2048) on the others;
# 3 dense MLPs of 12288 then 288 experts top-8 of 2048 + 1 shared; mHC over 4 streams. In bf16 a MoE layer is
# ~14.5 GB: the benchmark keeps the first GLM5_NEXT_LAYERS (KDA 0-2 and 4-5, the indexed layer 3; 3 dense + 3 MoE).
GLM5_NEXT_LAYERS = 6
GLM5_NEXT_BENCH: dict[str, Any] = {
    "model_type": "glm5_next",
    "architectures": ["Glm5NextForConditionalGeneration"],
    "text_config": {
        "vocab_size": 154880,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": GLM5_NEXT_LAYERS,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 256,
        "qk_rope_head_dim": 0,
        "v_head_dim": 256,
        "n_routed_experts": 288,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "routed_scaling_factor": 2.5,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_kpool": 4,
        "linear_num_heads": 64,
        "linear_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}

# the CPU smoke version of the benchmark geometry: the tiny test model's text config
TINY_GLM5_NEXT_BENCH: dict[str, Any] = {
    "model_type": "glm5_next",
    "architectures": ["Glm5NextForConditionalGeneration"],
    "text_config": {k: v for k, v in TINY_GLM5_NEXT_TEXT.items() if v is not None},
}
