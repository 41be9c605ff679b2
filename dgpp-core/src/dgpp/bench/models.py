"""Random-weight models of real geometries, built straight in device memory, for benchmarks.

transformers builds the model from a config (its own random init), and dgpp's model takes that model's
tensors, so both run the very same weights. Nothing touches the disk. When two copies do not fit on the
device (a 27B hybrid in bf16 is 54 GB), dgpp's parameters *are* transformers' tensors (shared storage).
Geometries transformers cannot build (its version lacks the model type) or that the caller runs without
the HF baseline get dgpp's own random init (:func:`build_random_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dgpp.step.model import Model
from dgpp.testing.glm_moe_dsa import GLM5_PACKED_QUANTIZATION


def _hybrid_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5's layout: every ``interval``-th layer full attention, the others Gated DeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


# Qwen3.5 rotary: theta 1e7 on the first quarter of each 256-wide head; mRoPE sections collapse to 1-D for text
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
# shared by both Qwen3.5 geometries: GDN sizes, tokenizer, context
_QWEN35_COMMON = {
    "vocab_size": 248320, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attn_output_gate": True, "rope_parameters": _QWEN35_ROPE,
}
# Qwen3.5-122B-A10B has 48 layers (240 GB in bf16); the benchmark keeps its per-layer shape and runs 24
# (18 GDN + 6 full attention, 60 GB of experts... 123 GB in all), which leaves K/V and workspace room on a 141 GB H200
MOE_122B_LAYERS = 24
_TINY_TEXT = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "initializer_range": 0.08, "tie_word_embeddings": False,
}
_TINY_QWEN35 = {
    **_TINY_TEXT, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4,
    "layer_types": _hybrid_layer_types(4), "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}

# MiMo-V2.6-Flash (anchor §3.9, the release's own config keys: model type mimo_v2) per layer: hidden 4096, 64 q
# heads of 192 (v 128), 4 KV heads on global layers and 8 on sliding-window ones (window 128 with a sink per
# head), 256 experts top-8 of 2048, no shared expert. Its 48 layers are 309B parameters (618 GB in bf16); the
# benchmark keeps the per-layer shape and runs 8: layer 0 global with the dense 16384 MLP, 1-4 sliding, 5 global,
# 6-7 sliding, 1-7 MoE (95 GB of bf16 weights), which leaves K/V and workspace room on a 141 GB H200
MIMO_V26_LAYERS = 8
_MIMO_V26_COMMON = {
    "model_type": "mimo_v2", "architectures": ["MiMoV2ForCausalLM"], "attention_projection_layout": "fused_qkv",
    "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False, "partial_rotary_factor": 0.334,
    "attention_value_scale": 0.707, "layernorm_epsilon": 1e-5, "rope_theta": 10000000.0, "swa_rope_theta": 10000.0,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
}


def _mimo_v26_pattern(num_layers: int) -> list[int]:
    """MiMo's layout (1 = sliding window): global attention on layer 0 and every sixth layer from 5 on."""
    return [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(num_layers)]


# DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash-0731, anchor §3.8) per layer: hidden 4096, 64 q heads x 512 over one
# shared latent, q_lora 1024, o_lora 1024 in 8 groups, a 128-token window everywhere, CSA (ratio 4, 64-head indexer
# x 128, top 512) and HCA (ratio 128) layers, 256 experts top-6 of 2048 + one shared, hash routing on layers 0-2,
# 4 hyper-connection streams. 43 layers are 570 GB in bf16 (the release ships MXFP4 experts): the benchmark keeps
# the per-layer shape and runs 8 (2 sliding, then CSA / HCA alternating, as the release starts), 106 GB.
V4_FLASH_LAYERS = 8
_V4_FLASH_TYPES = ["sliding_attention"] * 2 + [
    "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention" for i in range(V4_FLASH_LAYERS - 2)
]
_V4_FLASH = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280,
    "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": V4_FLASH_LAYERS,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "layer_types": _V4_FLASH_TYPES,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * (V4_FLASH_LAYERS - 3), "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                        "beta_fast": 32, "beta_slow": 1},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
# its CPU smoke version: every layer kind, window / ratios / top-k below the bench's prompts
_TINY_V4 = {
    **_V4_FLASH, "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 48, "o_groups": 2,
    "o_lora_rank": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "heavily_compressed_attention",
                                                            "compressed_sparse_attention", "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "index_n_heads": 16, "index_head_dim": 16, "index_topk": 2,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 512, "initializer_range": 0.08,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}

# Full GLM-5.3 (glm_moe_dsa, anchor §3.2) per layer: hidden 6144, MLA 64 heads (q_lora 2048, kv_lora 512, nope 192 +
# rope 64, v 256), DSA indexer 32 x 128 top-2048 on the freq-4 / offset-3 schedule, 256 experts top-8 of 2048 + 1
# shared; the int4 (routed experts) / int8 (attention, shared, dense MLP) group-64 release form. 78 layers do not
# fit one H200 even packed (~5 GB per MoE layer): the benchmark keeps the first GLM5_LAYERS (3 dense + 9 MoE, the
# indexer running on layers 0, 1, 2, 6 and 10 and the others reusing its selection, as in the release)
GLM5_LAYERS = 12
_GLM5 = {
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 154880, "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": GLM5_LAYERS,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0}, "max_position_embeddings": 1048576,
    "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "index_topk_freq": 4, "index_skip_topk_offset": 3, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "quantization_config": GLM5_PACKED_QUANTIZATION,
}

# HF config.json fields of the geometries the benchmarks run (random weights; values from the
# published configs of the models named)
GEOMETRIES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3.5-27B text_config (anchor §3.5): 64 layers = 48 GDN (16 k / 48 v heads x 128) + 16 gated full
    # attention (24 q / 4 kv heads x 256), SwiGLU 17408 after each, hidden 5120
    "qwen3.5-27b": {
        **_QWEN35_COMMON, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "layer_types": _hybrid_layer_types(64),
        "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48,
    },
    # Qwen/Qwen3.5-122B-A10B text_config (anchor §3.6) per layer: hidden 3072, 32 q / 2 kv heads x 256, GDN
    # 16 k / 64 v heads x 128, 256 experts top-8 of 1024 + a sigmoid-gated shared expert of 1024; 24 of 48 layers
    f"qwen3.5-122b-a10b-{MOE_122B_LAYERS}l": {
        **_QWEN35_COMMON, "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
        "hidden_size": 3072, "num_hidden_layers": MOE_122B_LAYERS, "layer_types": _hybrid_layer_types(MOE_122B_LAYERS),
        "num_attention_heads": 32, "num_key_value_heads": 2, "linear_num_value_heads": 64, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
    },
    f"mimo-v2.6-flash-{MIMO_V26_LAYERS}l": {
        **_MIMO_V26_COMMON, "vocab_size": 152576, "hidden_size": 4096, "intermediate_size": 16384,
        "moe_intermediate_size": 2048, "num_hidden_layers": MIMO_V26_LAYERS, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128, "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128, "sliding_window": 128,
        "hybrid_layer_pattern": _mimo_v26_pattern(MIMO_V26_LAYERS), "moe_layer_freq": [0] + [1] * (MIMO_V26_LAYERS - 1),
        "n_routed_experts": 256, "num_experts_per_tok": 8, "max_position_embeddings": 1048576,
    },
    f"deepseek-v4-flash-{V4_FLASH_LAYERS}l": _V4_FLASH,
    "tiny-deepseek-v4": _TINY_V4,
    f"glm-5.3-{GLM5_LAYERS}l": _GLM5,
    "tiny": {**_TINY_TEXT, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    # CPU smoke versions of the two hybrids (3 GDN layers + 1 full attention)
    "tiny-qwen3.5": _TINY_QWEN35,
    "tiny-qwen3.5-moe": {
        **{k: v for k, v in _TINY_QWEN35.items() if k != "intermediate_size"}, "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    },
    # CPU smoke version of the MiMo-V2.6 geometry: 6 layers (0 and 5 global), window 8, 8 experts top-2
    "tiny-mimo-v2.6": {
        **_MIMO_V26_COMMON, **{k: v for k, v in _TINY_TEXT.items() if k != "rms_norm_eps"}, "num_hidden_layers": 6,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 48, "v_head_dim": 32,
        "swa_num_attention_heads": 8, "swa_num_key_value_heads": 4, "swa_head_dim": 48, "swa_v_head_dim": 32,
        "sliding_window": 8, "hybrid_layer_pattern": _mimo_v26_pattern(6), "moe_layer_freq": [0] + [1] * 5,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
    },
}


def hf_config(geometry: str, dtype: torch.dtype) -> dict[str, Any]:
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; known: {', '.join(GEOMETRIES)}")
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    return {**GEOMETRIES[geometry], "dtype": name, "torch_dtype": name}


def new_model(raw_config: dict[str, Any], device: torch.device | str) -> Model:
    """The model its family plugin builds for an HF config dict (``dgpp_build_model``), parameters uninitialised."""
    from dgpp.errors import UnsupportedModelError
    from dgpp.family import LoadContext
    from dgpp.plugins import manager, resolve

    pm = manager()
    found = resolve(pm, raw_config)
    ctx = LoadContext(checkpoint_dir=Path(), hf_config=raw_config, family=found.family.name,
                      architecture=found.matched, device=device)
    model = pm.hook.dgpp_build_model(ctx=ctx)
    if model is None:
        raise UnsupportedModelError(f"family {found.family.name} (plugin {found.family.plugin}) builds no model "
                                    "without a checkpoint (dgpp_build_model)")
    return model


def transformers_knows(model_type: str) -> bool:
    """Whether the installed transformers can build ``model_type`` (the device's version may predate it)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return False
    return model_type in CONFIG_MAPPING


@torch.inference_mode()
def build_pair(
    geometry: str, device: str, dtype: torch.dtype, seed: int = 0, *, with_hf: bool = True,
) -> tuple[Model, torch.nn.Module | None]:
    """(dgpp model, transformers model) sharing the same random weights, both on ``device``. The
    transformers model is None when ``with_hf`` is off or transformers lacks the model type; dgpp's model
    then gets :func:`build_random_model`'s weights."""
    raw = hf_config(geometry, dtype)
    if not with_hf or not transformers_knows(raw["model_type"]):
        if with_hf:
            print(f"transformers has no model type {raw['model_type']!r}: dgpp's random model alone (HF column '-')")
        return build_random_model(geometry, device, dtype, seed), None
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(seed)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ours = build_model_like(raw, hf.state_dict(), device, share=not _second_copy_fits(hf, device))
    return ours, hf


def _second_copy_fits(module: torch.nn.Module, device: str, headroom: float = 1.25) -> bool:
    if torch.device(device).type != "cuda":
        return True
    need = sum(p.numel() * p.element_size() for p in module.parameters()) * headroom
    return torch.cuda.mem_get_info(torch.device(device))[0] > need


@torch.inference_mode()
def build_model_like(
    raw_config: dict[str, Any], state: dict[str, torch.Tensor], device: str, *, share: bool = False,
) -> Model:
    """A dgpp model for ``raw_config`` whose parameters come from ``state`` (HF names): copies, or with
    ``share`` the very tensors of ``state`` (no second copy; a write to one model then shows in both)."""
    # shared: build on the host, where the uninitialised (never touched) parameters cost no memory
    model = new_model(raw_config, "cpu" if share else device)
    for name, param in model.named_parameters():
        if name not in state:
            raise KeyError(f"benchmark weights have no tensor {name}")
        source = state[name]
        if share and source.shape == param.shape and source.dtype == param.dtype:
            param.data = source
        elif share:
            param.data = source.to(dtype=param.dtype, copy=True)
        else:
            param.copy_(source)
    return model.to(device)


def _init_value(model: torch.nn.Module, name: str, param: torch.Tensor) -> float | None:
    """The constant a 1-D parameter starts at (None: draw it): norms at their identity, ``(1 + w)`` norms at 0."""
    leaf = name.rpartition(".")[2]
    if leaf == "dt_bias":
        return 1.0
    owner = model.get_submodule(name.rpartition(".")[0])
    return 0.0 if getattr(owner, "zero_centered", False) else 1.0


def _fill_normal(param: torch.Tensor, std: float, gen: torch.Generator, chunk: int = 1 << 28) -> None:
    """N(0, std) drawn in fp32, in dim-0 slices for tensors over ``chunk`` elements (an expert stack is
    2.4G elements: one fp32 draw would need 10 GB)."""
    if param.numel() <= chunk:
        param.copy_(torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32) * std)
        return
    rows = max(1, chunk // max(1, param[0].numel()))
    for start in range(0, param.shape[0], rows):
        part = param[start : start + rows]
        part.copy_(torch.randn(part.shape, generator=gen, device=param.device, dtype=torch.float32) * std)


@torch.inference_mode()
def build_random_model(geometry: str, device: str, dtype: torch.dtype, seed: int = 0) -> Model:
    """A dgpp model with N(0, std) matrices, norms at identity and GDN decays as HF initialises them
    (A = U(1, 16), dt_bias 1); no transformers model kept."""
    raw = hf_config(geometry, dtype)
    std = float(raw.get("initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed)
    model = new_model(raw, device)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("A_log"):
            param.copy_((torch.rand(param.shape, generator=gen, device=device) * 15 + 1).log())
        elif name.endswith("tid2eid"):  # a hash router's token -> experts table: distinct experts per token
            experts = model.get_submodule(name.rpartition(".")[0]).cfg.num_experts
            picks = torch.rand(param.shape[0], experts, generator=gen, device=device).argsort(dim=-1)
            param.copy_(picks[:, : param.shape[1]])
        elif param.dim() == 1:
            param.fill_(_init_value(model, name, param))
        else:
            _fill_normal(param, std, gen)
    from dgpp.engine.weights import settle_weights

    return settle_weights(model)  # the forms a loaded model keeps (e.g. MLA's kv_b_proj decoded)


def weight_bytes_per_step(model: Model) -> int:
    """Bytes of weights a decode step reads: every parameter once, except the embedding table and a hash
    router's token table (one row per token is read; a tied LM head still reads it whole, counted once)."""
    total = 0
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        if (name.endswith("embed_tokens.weight") or name == "embed.weight") and not tied:
            continue
        if name.endswith("tid2eid"):
            continue
        total += param.numel() * param.element_size()
    return total
