"""Tiny random ``glm4_moe`` checkpoints in the release layout, MTP layer included.

transformers builds and saves the main stack (per-expert tensors, as GLM ships them) but keeps no MTP
weights, so the builder saves one extra decoder layer, renames nothing (the checkpoint already calls
it ``model.layers.{num_hidden_layers}``), adds the MTP-only tensors (``eh_proj``, ``enorm``, ``hnorm``,
``shared_head.norm``; optionally ``embed_tokens`` and ``shared_head.head`` as GLM-4.5 ships them) and
rewrites ``config.json`` so the extra layer is the MTP layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dgpp.testing.builders import save_one_file, spread_tensors

# GLM's MoE in miniature (GLM-4.x and GLM-5.3): one dense layer then MoE layers, 4 groups of 4 experts of which
# 2 groups are eligible, a shared expert, routed scaling.
TINY_GLM_MOE: dict[str, Any] = {
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}

# Small enough for a 2-core CPU test run, big enough that every GLM feature runs: GLM's MoE, q/k/v biases, q/k
# norm, partial RoPE.
TINY_GLM4_MOE: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "attention_bias": True,
    "use_qk_norm": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 512,
    **TINY_GLM_MOE,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "initializer_range": 0.08,
    "eos_token_id": [1, 2],
    "bos_token_id": None,
    "pad_token_id": 0,
}


def tiny_glm4_moe_config(**overrides: Any) -> dict[str, Any]:
    """The tiny config as a plain dict (what config.json will hold), with ``overrides`` applied."""
    cfg = dict(TINY_GLM4_MOE)
    cfg.update(overrides)
    return cfg


def _hf_config(cfg: dict[str, Any], num_layers: int, dtype: torch.dtype) -> Any:
    from transformers import Glm4MoeConfig

    kwargs = {
        k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "num_nextn_predict_layers")
    }
    kwargs["num_hidden_layers"] = num_layers
    kwargs["num_mtp_layers"] = cfg.get("num_nextn_predict_layers", 0)
    return Glm4MoeConfig(**kwargs, dtype=str(dtype).removeprefix("torch."))


def _spread_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    """HF initializes norms to 1 and biases / correction bias to 0; move them off those values so a
    loader that drops one of them (or swaps two) changes the logits."""
    spread_tensors(model.named_parameters(), gen, {"norm.weight": (1.0, 0.2), ".bias": (0.0, 0.1)})
    spread_tensors(model.named_buffers(), gen, {"e_score_correction_bias": (0.0, 0.2)})


def _mtp_extras(
    cfg: dict[str, Any], layer: int, dtype: torch.dtype, gen: torch.Generator, own_head: bool
) -> dict[str, Any]:
    hidden, vocab, std = cfg["hidden_size"], cfg["vocab_size"], cfg["initializer_range"]

    def rand(*shape: int, scale: float = std, base: float = 0.0) -> torch.Tensor:
        return (base + scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype).contiguous()

    pre = f"model.layers.{layer}."
    out = {
        pre + "eh_proj.weight": rand(hidden, 2 * hidden),
        pre + "enorm.weight": rand(hidden, scale=0.2, base=1.0),
        pre + "hnorm.weight": rand(hidden, scale=0.2, base=1.0),
        pre + "shared_head.norm.weight": rand(hidden, scale=0.2, base=1.0),
    }
    if own_head:  # some releases repeat the embedding and head inside the MTP layer
        out[pre + "embed_tokens.weight"] = rand(vocab, hidden)
        out[pre + "shared_head.head.weight"] = rand(vocab, hidden)
    return out


# What nvidia/GLM-4.7-NVFP4 keeps in BF16: attention, the head, and the MTP layer (its draft is requantized at load).
NVFP4_EXCLUDE = ("lm_head", "model.layers.*.self_attn*")


def _is_nvfp4_weight(name: str, num_layers: int) -> bool:
    """MLP / expert / shared-expert projection weights of the main stack (what ModelOpt quantizes)."""
    if not name.endswith("_proj.weight") or ".self_attn." in name or not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) < num_layers


def _nvfp4_roundtrip(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, dict[str, torch.Tensor]]:
    """Snap every quantizable weight onto the NVFP4 grid in place (so the dense checkpoint holds exactly
    the values the packed one decodes to) and return the ModelOpt tensors of each."""
    from dgpp.quant.encode import encode_fp4
    from dgpp.quant.fp4 import NVFP4ModelOpt

    fmt = NVFP4ModelOpt()
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(tensors):
        if not _is_nvfp4_weight(name, num_layers):
            continue
        w = tensors[name]
        snapped = fmt.decode(encode_fp4(w.float(), fmt), (w.shape[0], w.shape[1]), torch.float32)
        tensors[name] = snapped.to(w.dtype)
        enc = encode_fp4(snapped, fmt)
        enc["input_scale"] = torch.ones(1, dtype=torch.float32)  # shipped, unused by weight-only kernels
        packed[name] = enc
    return packed


def nvfp4_twin(dense_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Write the ModelOpt NVFP4 release form of a tiny checkpoint whose quantizable weights are already on
    the NVFP4 grid (``build_tiny_glm4_moe(nvfp4_grid=True)``): same config plus ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    dense, out = Path(dense_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(dense / "model.safetensors")
    packed = _nvfp4_roundtrip(tensors, num_layers)
    for name, enc in packed.items():
        del tensors[name]
        prefix = name[: -len("weight")]
        tensors.update({prefix + suffix: t.contiguous() for suffix, t in enc.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": [
            *NVFP4_EXCLUDE,
            *(f"model.layers.{num_layers + i}*" for i in range(config["num_nextn_predict_layers"])),
        ],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def build_tiny_glm4_moe(
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    mtp_own_head: bool = False,
    nvfp4_grid: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random ``Glm4MoeForCausalLM`` checkpoint (config.json + model.safetensors) to ``out_dir``.

    With ``num_nextn_predict_layers`` = M > 0 the file also holds M MTP layers at
    ``model.layers.{num_hidden_layers + i}``; ``mtp_own_head`` adds their own embedding and head copies.
    ``nvfp4_grid`` snaps the MLP/expert weights onto the NVFP4 grid, for ``nvfp4_twin``.
    """
    from safetensors.torch import load_file
    from transformers import Glm4MoeForCausalLM

    out = Path(out_dir)
    cfg = tiny_glm4_moe_config(**overrides)
    layers, mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    # Build the stack with the MTP layers as ordinary trailing decoder layers: their tensors then carry
    # exactly the names (and per-expert layout) the release uses for them.
    model = Glm4MoeForCausalLM(_hf_config(cfg, layers + mtp, dtype)).to(dtype).eval()
    _spread_weights(model, gen)
    weights_path = save_one_file(model, out, "glm4_moe") / "model.safetensors"
    tensors = load_file(weights_path)
    if nvfp4_grid:
        _nvfp4_roundtrip(tensors, layers)
    declare_mtp(out, tensors, cfg, layers, mtp, dtype, gen, mtp_own_head)
    return out


def declare_mtp(
    out: Path,
    tensors: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    layers: int,
    mtp: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    own_head: bool,
) -> None:
    """The trailing ``mtp`` decoder blocks of a saved stack become MTP layers: their MTP-only tensors are added to
    ``tensors`` (written back as ``model.safetensors``), and config.json declares ``layers`` decoder layers (its
    per-layer lists cut back) and ``num_nextn_predict_layers`` = ``mtp``."""
    from safetensors.torch import save_file

    for i in range(mtp):
        tensors.update(_mtp_extras(cfg, layers + i, dtype, gen, own_head))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config["num_nextn_predict_layers"] = mtp
    config.pop("num_mtp_layers", None)
    for key in ("indexer_types", "mlp_layer_types", "layer_types"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
