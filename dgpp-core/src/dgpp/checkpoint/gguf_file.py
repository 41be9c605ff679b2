"""One GGUF file, read with the ``gguf`` package: its metadata as plain Python values and its tensors
decoded to torch under HF names (the architecture's table in ``gguf_arch``).

Opening needs the optional dependency ``gguf`` (``pip install 'dgpp-core[gguf]'``); without it the error
says so. Everything wrong with a file names the file and the key or tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from dgpp.checkpoint.gguf_blocks import BLOCK_BYTES, block_rows, decode_tensor
from dgpp.errors import CheckpointError


def _gguf_module():
    try:
        import gguf
    except ImportError as e:
        raise CheckpointError(
            "reading a GGUF checkpoint needs the 'gguf' package: pip install 'dgpp-core[gguf]' (or pip install gguf)"
        ) from e
    return gguf


def _field_value(field: Any) -> Any:
    """A metadata field as str / int / float / bool, or a list of those for arrays."""
    gguf = _gguf_module()
    kinds = field.types
    if not kinds:
        return None
    if kinds[0] == gguf.GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if len(kinds) > 1 and kinds[1] == gguf.GGUFValueType.STRING:
            return [bytes(item).decode("utf-8", errors="replace") for item in items]
        return [item.tolist()[0] if hasattr(item, "tolist") else item for item in items]
    part = field.parts[field.data[0]]
    if kinds[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part.tolist()[0]
    return bool(value) if kinds[0] == gguf.GGUFValueType.BOOL else value


class GGUFFile:
    """Metadata and raw tensors of ``path`` (memory-mapped; tensors are decoded when asked for)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        gguf = _gguf_module()
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:  # the reader raises ValueError / struct errors for a bad header
            raise CheckpointError(f"{self.path}: cannot read as GGUF ({e})") from e
        self.metadata: dict[str, Any] = {
            name: _field_value(field)
            for name, field in self._reader.fields.items()
            if not name.startswith("GGUF.")
        }
        self._tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def type_name(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """Row-major (torch) shape: ggml lists dimensions innermost first."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def _info(self, name: str) -> Any:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        return self._tensors[name]

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` decoded (float types keep their dtype; block quants become exact fp32)."""
        info = self._info(name)
        raw = np.asarray(info.data)
        return decode_tensor(raw, info.tensor_type.name, self.shape(name), f"{self.path}: tensor {name!r}")

    def blocks(self, name: str) -> torch.Tensor | None:
        """Block-quant tensor ``name``'s raw blocks, ``[rows, bytes a row]`` uint8 (``gguf_blocks.block_rows``);
        None for a float tensor."""
        info = self._info(name)
        if info.tensor_type.name not in BLOCK_BYTES:
            return None
        raw = np.asarray(info.data)
        return block_rows(raw, info.tensor_type.name, self.shape(name), f"{self.path}: tensor {name!r}")
