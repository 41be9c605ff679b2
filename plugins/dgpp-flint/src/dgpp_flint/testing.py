"""Tiny random ``flint`` checkpoints in the release layout, and their per-projection FP8 / NVFP4 expert twins.

transformers builds and saves the model (per-expert tensors, the sink saved as ``softmax_offset`` as Flint
ships it). The default shape has both attention kinds (layers 0, 1 and 5 full, 2-4 sliding), dense layers
0-1 then MoE layers, and a window of 8 tokens, so prompts longer than the window exercise it and the sinks.

``tiny_checkpoints`` offers the builder (``flint``) to core, ``bench_geometries`` the release geometry (``flint``) and
``tiny-flint`` to ``dgpp bench``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dgpp.plugin_api import BenchGeometry, PackedRelease, TinyCheckpoint
from dgpp.testing.builders import save_one_file, spread_tensors

TINY_FLINT: dict[str, Any] = {
    "architectures": ["FlintForCausalLM"],
    "model_type": "flint",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "sliding_window": 8,
    "mlp_only_layers": [0, 1],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.08,
    "eos_token_id": [1, 2],
    "bos_token_id": None,
    "pad_token_id": 0,
}


def tiny_flint_config(**overrides: Any) -> dict[str, Any]:
    cfg = dict(TINY_FLINT)
    cfg.update(overrides)
    return cfg


def _spread_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norms away from 1 and sinks of order 1 (HF initializes them at 1 and N(0, 0.08)), so a loader that
    drops either, or attention that ignores the sinks, changes the logits."""
    spread_tensors(model.named_parameters(), gen, {"norm.weight": (1.0, 0.2), ".sinks": (0.0, 1.5)})


def build_tiny_flint(
    out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Write a random ``FlintForCausalLM`` checkpoint (config.json + model.safetensors) to ``out_dir``."""
    from transformers import FlintConfig, FlintForCausalLM

    out = Path(out_dir)
    cfg = tiny_flint_config(**overrides)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = FlintForCausalLM(FlintConfig(**kwargs, dtype=str(dtype).removeprefix("torch."))).to(dtype).eval()
    _spread_weights(model, torch.Generator().manual_seed(seed + 1))
    return save_one_file(model, out, "flint")


def _expert_regex(layer: int, projections: tuple[str, ...]) -> str:
    return rf"re:model\.layers\.{layer}\.mlp\.experts\.\d+\.({'|'.join(projections)})$"


# The export's per-projection layout in miniature: an FP8 block-128 layer, an NVFP4 layer and two layers that
# mix the two across gate_proj / up_proj / down_proj.
MIXED_EXPERT_FORMATS: dict[int, dict[str, str]] = {
    2: {"gate_proj": "fp8", "up_proj": "fp8", "down_proj": "fp8"},
    3: {"gate_proj": "nvfp4", "up_proj": "nvfp4", "down_proj": "nvfp4"},
    4: {"gate_proj": "fp8", "up_proj": "fp8", "down_proj": "nvfp4"},
    5: {"gate_proj": "nvfp4", "up_proj": "fp8", "down_proj": "fp8"},
}


def quantization_config(layout: dict[int, dict[str, str]]) -> dict[str, Any]:
    """compressed-tensors ``config_groups``: one FP8 block-128 group and one NVFP4 group, each targeting the
    expert projections ``layout`` gives it (everything else stays BF16)."""
    targets: dict[str, list[str]] = {"fp8": [], "nvfp4": []}
    for layer, per_proj in sorted(layout.items()):
        for kind in targets:
            projs = tuple(p for p, k in per_proj.items() if k == kind)
            if projs:
                targets[kind].append(_expert_regex(layer, projs))
    groups = {}
    if targets["fp8"]:
        groups["group_0"] = {
            "targets": targets["fp8"],
            "format": "float-quantized",
            "weights": {
                "type": "float",
                "num_bits": 8,
                "strategy": "block",
                "block_structure": [128, 128],
                "symmetric": True,
            },
        }
    if targets["nvfp4"]:
        groups["group_1"] = {
            "targets": targets["nvfp4"],
            "format": "nvfp4-pack-quantized",
            "weights": {
                "type": "float",
                "num_bits": 4,
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
            },
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": groups,
        "ignore": ["lm_head"],
    }


def mixed_expert_twins(
    dense_dir: str | Path, quant_dir: str | Path, layout: dict[int, dict[str, str]] | None = None
) -> tuple[Path, Path]:
    """Snap every routed-expert weight of ``dense_dir`` onto its format's grid in place (so the dense file holds
    exactly what the packed one decodes to), and write the packed release form to ``quant_dir``."""
    from safetensors.torch import load_file, save_file

    from dgpp.quant.encode import encode_fp4, encode_fp8_block
    from dgpp.quant.fp4 import NVFP4CompressedTensors
    from dgpp.quant.fp8 import FP8Block

    layout = MIXED_EXPERT_FORMATS if layout is None else layout
    fmts = {"fp8": FP8Block(block=(128, 128), scale_name="weight_scale"), "nvfp4": NVFP4CompressedTensors()}
    encoders: dict[str, Callable[[torch.Tensor, Any], dict[str, torch.Tensor]]] = {
        "fp8": encode_fp8_block,
        "nvfp4": encode_fp4,
    }
    dense, quant = Path(dense_dir), Path(quant_dir)
    quant.mkdir(parents=True, exist_ok=True)
    tensors = load_file(dense / "model.safetensors")
    packed: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        parts = name.split(".")
        if len(parts) != 8 or parts[3:5] != ["mlp", "experts"] or parts[-1] != "weight":
            continue
        kind = layout.get(int(parts[2]), {}).get(parts[6])
        if kind is None:
            continue
        w, fmt = tensors[name], fmts[kind]
        snapped = fmt.decode(encoders[kind](w.float(), fmt), (w.shape[0], w.shape[1]), torch.float32).to(
            w.dtype
        )
        tensors[name] = snapped
        prefix = name[: -len("weight")]
        packed.update({prefix + k: t.contiguous() for k, t in encoders[kind](snapped.float(), fmt).items()})
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    for name in [n for n in tensors if n[: -len("weight")] + "weight_scale" in packed]:
        del tensors[name]
    tensors.update(packed)
    save_file(tensors, quant / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = quantization_config(layout)
    (quant / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return dense, quant


# An export layout of the kind the release describes (FP8 block-128 layers, NVFP4 layers, two layers mixing the two
# across gate/up/down); which layer holds which format is an assumption, the byte rules are the formats'.
RELEASE_LAYOUT: dict[int, dict[str, str]] = {
    **{i: dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "fp8") for i in range(2, 25)},
    **{i: dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "nvfp4") for i in range(25, 47)},
    47: {"gate_proj": "fp8", "up_proj": "fp8", "down_proj": "nvfp4"},
    48: {"gate_proj": "nvfp4", "up_proj": "nvfp4", "down_proj": "fp8"},
}
# Flint as transformers' FlintConfig defaults describe the release (transformers >= 5.24), with its export's
# quantization_config.
FLINT_RELEASE: dict[str, Any] = {
    "architectures": ["FlintForCausalLM"],
    "model_type": "flint",
    "vocab_size": 150144,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 1024,
    "num_hidden_layers": 49,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "sliding_window": 513,
    "mlp_only_layers": [0, 1],
    "decoder_sparse_step": 1,
    "num_experts": 256,
    "num_experts_per_tok": 6,
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": quantization_config(RELEASE_LAYOUT),
}


def tiny_checkpoints() -> list[TinyCheckpoint]:
    return [TinyCheckpoint("flint", build_tiny_flint, "Flint: sliding and full attention with sinks, MoE")]


def bench_geometries() -> list[BenchGeometry]:
    """The release geometry and its CPU smoke version; ``dgpp bench --quant release`` packs their routed experts
    per layer and projection as the export does (``RELEASE_LAYOUT``; the tiny one ``MIXED_EXPERT_FORMATS``)."""
    shapes = {k: v for k, v in FLINT_RELEASE.items() if k != "quantization_config"}
    return [
        BenchGeometry(
            "flint",
            shapes,
            "Flint, FP8 block-128 and NVFP4 routed experts per layer and projection (--quant release)",
            release=PackedRelease(quantization_config=quantization_config(RELEASE_LAYOUT)),
        ),
        BenchGeometry(
            "tiny-flint",
            TINY_FLINT,
            "its CPU smoke version",
            release=PackedRelease(quantization_config=quantization_config(MIXED_EXPERT_FORMATS)),
        ),
    ]
