"""Tiny full GLM-5.3 checkpoints in the NF4I8 re-encoding (``quant_method: dgpp_nf4i8``), with a dense twin that
computes the same function, for tests against transformers.

On one inclusive layer range the routed experts become 4-bit codebook indices with a BF16 scale per 128 inputs,
encoded in the rotated basis (``W·R``, ``R`` the block-diagonal normalized 32-wide Hadamard, its own inverse),
and the attention projections and shared experts int8 group-64 pack-quantized; the rest stays dense. The twin
holds, for each encoded expert, the weight the engine applies to an unrotated input: ``decode(W·R) · R``
(computed in float64, rounded once), and the int8 tensors decoded: transformers then runs the function the
packed checkpoint defines with no rotation of its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from dgpp.quant.codebook import NF4I8_LEVELS, ROTATION_BLOCK, NF4Codebook
from dgpp.quant.codecs import pack_int32

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight")


def nf4i8_quantization(first: int, last: int) -> dict[str, Any]:
    """``quantization_config`` of the NF4I8 release form for packed layers ``first..last``."""
    return {
        "quant_method": "dgpp_nf4i8",
        "format": "mixed-codebook-packed",
        "format_version": 1,
        "retained_int8": {"group_size": 64, "scale_dtype": "bfloat16", "layers": [first, last]},
        "routed_experts": {
            "bits": 4,
            "group_size": 128,
            "indices_dtype": "int32",
            "indices_key": "weight_indices",
            "scale_dtype": "bfloat16",
            "codebook": list(NF4I8_LEVELS),
            "layers": [first, last],
            "input_transform": {
                "type": "normalized_hadamard",
                "block_size": ROTATION_BLOCK,
                "axis": "input_channels",
                "apply_to": ["gate_proj", "up_proj", "down_proj"],
            },
        },
    }


def rotation(k: int) -> torch.Tensor:
    """``[k, k]`` float64 block-diagonal normalized Sylvester Hadamard (entry ``(-1)^popcount(i & j) / √32``)."""
    idx = torch.arange(ROTATION_BLOCK)
    bits = (idx[:, None] & idx[None, :]).to(torch.int64)
    parity = torch.zeros_like(bits)
    for b in range(5):
        parity ^= (bits >> b) & 1
    block = (1 - 2 * parity).double() / ROTATION_BLOCK**0.5
    return torch.block_diag(*[block] * (k // ROTATION_BLOCK))


def encode_nf4i8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Round-to-nearest codebook encode of an ``[N, K]`` weight (already in the rotated basis): per 128 inputs
    ``scale = bf16(max|w| / 127)``, each value the nearest level of ``w / scale`` (a midpoint to the lower index)."""
    n, k = w.shape
    groups = w.double().view(n, k // 128, 128)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(torch.bfloat16)
    levels = torch.tensor(NF4I8_LEVELS, dtype=torch.float64)
    index = (groups / scale.double()).unsqueeze(-1).sub(levels).abs().argmin(-1)  # argmin: the first of a tie
    return {
        "weight_indices": pack_int32(index.view(n, k), 4, dim=1),
        "weight_scale": scale.view(n, k // 128).contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }


def nf4i8_twin(dense_dir: str | Path, root: str | Path, first: int, last: int) -> tuple[Path, Path]:
    """``(packed, reference)`` checkpoints under ``root`` from a dense tiny checkpoint (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    from dgpp.quant.checkpoints import dequantize_checkpoint, quantize_checkpoint

    root = Path(root)
    layers = "(?:" + "|".join(str(i) for i in range(first, last + 1)) + ")"
    int8_only = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "retained_int8": {
                "targets": [
                    rf"re:model\.layers\.{layers}\.(?:self_attn\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa|"
                    rf"kv_b_proj|o_proj)|mlp\.shared_experts\.(?:gate|up|down)_proj)$"
                ],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "strategy": "group",
                    "group_size": 64,
                    "symmetric": True,
                },
                "format": "pack-quantized",
            }
        },
    }
    int8 = quantize_checkpoint(dense_dir, root / "int8", int8_only)
    reference = dequantize_checkpoint(int8, root / "reference")
    packed_tensors = load_file(int8 / "model.safetensors")
    reference_tensors = load_file(reference / "model.safetensors")
    fmt = NF4Codebook()
    for name in sorted(packed_tensors):
        match = _EXPERT.fullmatch(name)
        if match is None or not first <= int(match.group(1)) <= last:
            continue
        w = packed_tensors.pop(name)
        r = rotation(w.shape[1])
        encoded = encode_nf4i8(w.double() @ r)
        packed_tensors.update({name[: -len("weight")] + suffix: t for suffix, t in encoded.items()})
        applied = fmt.decode(encoded, tuple(w.shape), torch.float64) @ r
        reference_tensors[name] = applied.to(w.dtype)
    save_file(packed_tensors, int8 / "model.safetensors", metadata={"format": "pt"})
    save_file(reference_tensors, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((int8 / "config.json").read_text())
    config["quantization_config"] = nf4i8_quantization(first, last)
    packed = int8.rename(root / "nf4i8")
    (packed / "config.json").write_text(json.dumps(config, indent=2))
    return packed, reference
