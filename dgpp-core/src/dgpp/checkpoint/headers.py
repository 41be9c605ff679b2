"""Stored bytes of a checkpoint's tensors, read from the safetensors headers alone (no tensor is read)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from dgpp.errors import CheckpointError


def tensor_bytes(checkpoint_dir: Path) -> dict[str, int]:
    """Stored bytes of every tensor, from the safetensors headers (the index when sharded)."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{checkpoint_dir}: no *.safetensors files (and no model.safetensors.index.json)"
        )
    sizes: dict[str, int] = {}
    for name in files:
        path = checkpoint_dir / name
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
        for tensor, meta in header.items():
            if tensor != "__metadata__":
                start, end = meta["data_offsets"]
                sizes[tensor] = end - start
    return sizes
