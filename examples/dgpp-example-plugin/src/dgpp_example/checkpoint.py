"""The toy checkpoint format: config.json + one model.safetensors whose names match ``ToyModel``'s parameters.

``write_toy_checkpoint`` makes a seeded random one (for tests and trying the plugin out);
``load_toy`` reads one back, refusing a missing or mis-shaped tensor by name and file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dgpp.errors import CheckpointError, ConfigError
from dgpp_example.model import ToyConfig, ToyModel

ARCHITECTURE = "ToyForCausalLM"
MODEL_TYPE = "dgpp_toy"
TINY = ToyConfig(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=256,
    eos_token_id=1,
)


def parse_config(hf_config: dict[str, Any]) -> ToyConfig:
    """config.json -> ToyConfig; a missing key is named."""
    known = {f.name for f in fields(ToyConfig)}
    optional = {"rms_norm_eps", "eos_token_id"}
    missing = sorted(known - optional - set(hf_config))
    if missing:
        raise ConfigError(
            f"config.json: missing key {missing[0]} (toy needs {', '.join(sorted(known - optional))})"
        )
    return ToyConfig(**{k: hf_config[k] for k in known if k in hf_config})


def write_toy_checkpoint(out_dir: str | Path, cfg: ToyConfig = TINY, seed: int = 0) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = ToyModel(cfg)
    with torch.no_grad():
        for p in model.parameters():  # break the ones-init of norms so a skipped norm weight is caught
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    config = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": "float32", **asdict(cfg)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_toy(
    checkpoint_dir: Path, hf_config: dict[str, Any], dtype: torch.dtype | None, device: Any
) -> ToyModel:
    cfg = parse_config(hf_config)
    path = checkpoint_dir / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the toy checkpoint is one model.safetensors)")
    tensors = load_file(str(path))
    model = ToyModel(cfg, dtype=dtype or torch.float32)
    for name, param in model.state_dict().items():
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} is missing from {path}")
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {name!r} in {path} has shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
            )
    model.load_state_dict(tensors, strict=False)  # every expected name was checked above; extras are ignored
    return model.to(device).eval()
