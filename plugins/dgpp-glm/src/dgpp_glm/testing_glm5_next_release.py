"""Tiny random GLM-5.3-Flash checkpoints in the layouts the two releases ship, and their dequantized twins.

``write_release_checkpoint`` builds the tiny ``glm5_next`` model (``dgpp_glm.testing_glm5_next``) with one more
indexed MoE layer, which becomes the MTP layer the releases ship at ``layers.{num_hidden_layers}`` (its
hyper-connection tensors dropped, ``enorm``, ``hnorm``, ``eh_proj`` ``[H, 2H]`` and ``shared_head.norm`` added),
writes the release's config keys (``deepseek_sparse_attention`` layer types, ``linear_attn_config``,
``num_nextn_predict_layers`` ...) and packs it as a release does (``dgpp_glm.glm5_next_release``): ``fp8`` is
``unsloth/GLM-5.3-Flash-FP8``, ``nvfp4-fp8`` is ``HawkBearPig/GLM-5.3-Flash-NVFP4-FP8`` (``quant_method:
dgpp_mixed``). The twin is the packed checkpoint decoded to dense float32: the values the engine serves.
``intermediate_size`` 160 gives the dense MLP a two-block FP8 scale grid with a partial edge block.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from dgpp.quant.checkpoints import dequantize_checkpoint, quantize_checkpoint
from dgpp_glm.glm5_next_config import INDEXED, Glm5NextArchConfig
from dgpp_glm.glm5_next_release import release_dense_modules
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next, tiny_glm5_next_text_config

Variant = Literal["fp8", "nvfp4-fp8"]
FP8_BLOCK = [128, 128]
# keys only the release's own parser reads, at the values GLM-5.3-Flash ships
RELEASE_KEYS: dict[str, Any] = {
    "mla_use_nope": True,
    "index_kpool_compress": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_router_dtype": "float32",
    "mhc": True,
}


def fp8_quantization(dense_modules: list[str]) -> dict[str, Any]:
    """``unsloth/GLM-5.3-Flash-FP8``'s ``quantization_config``: E4M3 with F32 128 x 128 block scales."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": FP8_BLOCK,
        "modules_to_not_convert": [*dense_modules, "model.visual"],
    }


def mixed_quantization(cfg: Glm5NextArchConfig, dense_modules: list[str]) -> dict[str, Any]:
    """``HawkBearPig/GLM-5.3-Flash-NVFP4-FP8``'s ``quantization_config`` (``dgpp_mixed``)."""
    return {
        "quant_method": "dgpp_mixed",
        "routed_experts": {
            "layers": [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)],
            "format": "nvfp4-pack-quantized",
            "num_bits": 4,
            "group_size": 16,
            "symmetric": True,
            "scale_dtype": "torch.float8_e4m3fn",
            "global_scale_dtype": "torch.float32",
            "tensor_suffixes": ["weight_packed", "weight_scale", "weight_global_scale"],
        },
        "fp8": fp8_quantization(dense_modules),
        "mtp_layer": {"index": cfg.num_hidden_layers, "source": "base"},
        "dsa_attention": {
            "layers": [i for i in range(cfg.num_hidden_layers) if not cfg.is_linear(i)],
            "source": "base",
        },
    }


def _release_text_config(text: dict[str, Any], layers: int) -> dict[str, Any]:
    """The saved text config cut to ``layers`` decoder layers plus one MTP layer, in the release's spelling."""
    out = dict(text)
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        out[key] = out[key][:layers]
    kinds = out["layer_types"]
    out["layer_types"] = ["deepseek_sparse_attention" if k == INDEXED else k for k in kinds]
    out["linear_attn_config"] = {
        "kda_layers": [i for i, k in enumerate(kinds) if k != INDEXED],
        "full_attn_layers": [i for i, k in enumerate(kinds) if k == INDEXED],
        "num_heads": out["linear_num_heads"],
        "head_dim": out["linear_head_dim"],
        "short_conv_kernel_size": out["linear_conv_kernel_dim"],
        "gate_lower_bound": out["linear_lower_bound"],
    }
    out.update(
        RELEASE_KEYS,
        num_hidden_layers=layers,
        num_nextn_predict_layers=1,
        first_k_dense_replace=out["mlp_layer_types"].count("dense"),
    )
    return out


def _mtp_tensors(
    layer: str, hidden: int, gen: torch.Generator, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    def draw(*shape: int, mean: float = 0.0, std: float = 0.08) -> torch.Tensor:
        return (mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)

    return {
        layer + "enorm.weight": draw(hidden, mean=1.0, std=0.2),
        layer + "hnorm.weight": draw(hidden, mean=1.0, std=0.2),
        layer + "eh_proj.weight": draw(hidden, 2 * hidden),
        layer + "shared_head.norm.weight": draw(hidden, mean=1.0, std=0.2),
    }


def _write_dense_release(out: Path, *, seed: int, dtype: torch.dtype, overrides: dict[str, Any]) -> Path:
    """The tiny model with its MTP layer under the release's names and config keys, not yet quantized."""
    from safetensors.torch import load_file, save_file

    text = tiny_glm5_next_text_config(**{"intermediate_size": 160, **overrides})
    layers = text["num_hidden_layers"]
    with_mtp = {
        "num_hidden_layers": layers + 1,
        "layer_types": [*text["layer_types"], INDEXED],
        "indexer_types": [*text["indexer_types"], "full"],
        "mlp_layer_types": [*text["mlp_layer_types"], "sparse"],
    }
    build_tiny_glm5_next(out, seed=seed, dtype=dtype, **{**text, **with_mtp})
    tensors = load_file(out / "model.safetensors")
    mtp = f"model.language_model.layers.{layers}."
    for name in [n for n in tensors if n.startswith(mtp + "hc_")]:
        del tensors[name]  # the MTP layer is a plain pre-norm block
    gen = torch.Generator().manual_seed(seed + 7)
    tensors.update(_mtp_tensors(mtp, text["hidden_size"], gen, dtype))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["text_config"] = _release_text_config(config["text_config"], layers)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def write_release_checkpoint(
    out_dir: str | Path,
    twin_dir: str | Path,
    *,
    variant: Variant = "nvfp4-fp8",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> tuple[Path, Path]:
    """A tiny checkpoint in ``variant``'s release layout at ``out_dir`` and its dequantized twin at ``twin_dir``;
    ``overrides`` update the tiny text config."""
    with tempfile.TemporaryDirectory() as tmp:
        dense = _write_dense_release(Path(tmp) / "dense", seed=seed, dtype=dtype, overrides=overrides)
        cfg = Glm5NextArchConfig.from_hf_config(json.loads((dense / "config.json").read_text()))
        modules = release_dense_modules(cfg)
        qc = fp8_quantization(modules) if variant == "fp8" else mixed_quantization(cfg, modules)
        packed = quantize_checkpoint(dense, out_dir, qc)
    return packed, dequantize_checkpoint(packed, twin_dir)
