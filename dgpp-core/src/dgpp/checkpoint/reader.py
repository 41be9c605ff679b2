"""Read a safetensors checkpoint: one ``*.safetensors`` file, several, or a sharded
``model.safetensors.index.json``. Tensors are memory-mapped through ``safe_open`` and read on demand."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dgpp.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointReader:
    """Name -> file map of a checkpoint directory, with shape/dtype look-ups and tensor reads.

    Raises ``CheckpointError`` naming the directory or file when the checkpoint is missing, its index
    is unreadable, or the index names a file that is absent.
    """

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.dir = Path(checkpoint_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self._handles: dict[Path, object] = {}
        self.index_path: Path | None = None
        self.file_of: dict[str, Path] = self._map_files()

    def _map_files(self) -> dict[str, Path]:
        index = self.dir / INDEX_NAME
        if index.exists():
            self.index_path = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            files = {name: self.dir / fname for name, fname in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.exists():
                    raise CheckpointError(
                        f"{index} names shard {path.name}, which is missing from {self.dir}"
                    )
            return files
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"no *.safetensors files and no {INDEX_NAME} in {self.dir}")
        files: dict[str, Path] = {}
        for path in shards:
            for name in self._open(path).keys():
                files[name] = path
        return files

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{path}: cannot open as safetensors ({e})") from e
            self._handles[path] = handle
        return handle

    def names(self) -> list[str]:
        return sorted(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def where(self, name: str) -> str:
        """The file holding ``name`` (for messages), or what was searched when it is absent."""
        path = self.file_of.get(name)
        return str(path) if path else self.searched()

    def searched(self) -> str:
        """The index, or the safetensors file(s), a look-up went through (for messages)."""
        if self.index_path is not None:
            return str(self.index_path)
        files = sorted({p.name for p in self.file_of.values()})
        return f"{self.dir}/{files[0]}" if len(files) == 1 else f"{self.dir}/{{{','.join(files)}}}"

    def _require(self, name: str) -> Path:
        path = self.file_of.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} is missing from {self.searched()}")
        return path

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._require(name)).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._open(self._require(name)).get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self.where(name)} has unsupported dtype {code}")
        return _DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        path = self._require(name)
        try:
            return self._open(path).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"tensor {name!r} in {path}: cannot be read ({e})") from e

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Only ``[start, start+length)`` along ``dim`` of ``name``: a TP rank reads its slice, not the whole."""
        path = self._require(name)
        try:
            view = self._open(path).get_slice(name)
            index = [slice(None)] * len(view.get_shape())
            index[dim] = slice(start, start + length)
            return view[tuple(index)]
        except Exception as e:
            raise CheckpointError(f"tensor {name!r} in {path}: cannot be read ({e})") from e

    def close(self) -> None:
        self._handles.clear()
