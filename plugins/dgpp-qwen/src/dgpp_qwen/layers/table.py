"""The PLE n-gram table of one layer, resident or memory-mapped (``engine.ngram_table``).

A release stores each layer's table as ``ngram_embedding.shard_{k}.weight`` (``split_ngram_parts`` row
shards, concatenated in order) or as one ``ngram_embedding.weight``. ``resident`` copies the rows into one
tensor on the model's device; ``mmap`` maps the safetensors files read-only-in-effect (private pages)
and gathers the looked-up rows on the host, so the table costs no device or resident host memory. Both
return the same bytes for the same rows, so the two modes are exactly equal.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.plugin_api import CheckpointError, CheckpointReader


class TableRows(Protocol):
    """What the table reads of the layer's n-gram hasher (``dgpp_qwen.layers.ngram.NGramHasher``)."""

    @property
    def rows_needed(self) -> int: ...
    @property
    def table_rows(self) -> int: ...


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
TABLE_MODES = ("resident", "mmap")


@dataclass
class MappedPart:
    """Rows ``[start, start + len(rows))`` of the table, a view into a mapped file."""

    start: int
    rows: torch.Tensor


def _map_tensor(
    path: Path, name: str, maps: dict[Path, tuple[mmap.mmap, dict[str, Any], int]]
) -> torch.Tensor:
    if path not in maps:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            # ACCESS_COPY: private pages, so torch gets a writable buffer and the file is never written
            maps[path] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), header, 8 + header_len)
    mapped, header, data_start = maps[path]
    entry = header[name]
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(f"tensor {name!r} in {path}: dtype {entry['dtype']} cannot be memory-mapped")
    begin, end = entry["data_offsets"]
    count = (end - begin) // dtype.itemsize
    return torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + begin).view(entry["shape"])


class NGramEmbedding(nn.Module):
    """Hasher + table; ``forward(row_ids [T, heads])`` -> ``[T, heads * dim]`` on the ids' device."""

    def __init__(self, hasher: TableRows, dim: int) -> None:
        super().__init__()
        self.hasher = hasher
        self.dim = dim
        self.mode: str | None = None
        self.register_buffer("table", None, persistent=False)  # resident rows
        self.parts: list[MappedPart] = []
        self._maps: dict[Path, tuple[mmap.mmap, dict[str, Any], int]] = {}

    def tensor_names(self, reader: CheckpointReader, prefix: str, split_parts: int) -> list[str]:
        """The checkpoint tensors holding this table, in row order (``prefix`` ends in ``ngram_embedding``)."""
        if f"{prefix}.weight" in reader:
            return [f"{prefix}.weight"]
        names = [f"{prefix}.shard_{k}.weight" for k in range(split_parts)]
        for name in names:
            if name not in reader:
                raise CheckpointError(
                    f"tensor {name!r} (PLE n-gram table shard) is missing from {reader.searched()}"
                )
        return names

    def load(
        self, reader: CheckpointReader, prefix: str, split_parts: int, mode: str, device: torch.device | str
    ) -> None:
        if mode not in TABLE_MODES:
            raise ValueError(f"engine.ngram_table = {mode!r}; expected one of {', '.join(TABLE_MODES)}")
        names = self.tensor_names(reader, prefix, split_parts)
        rows = 0
        for name in names:
            if reader.dtype(name) not in _SAFETENSORS_DTYPES.values():
                # FP8 releases store codes plus a scale; looking the codes up as values would be silently wrong
                raise CheckpointError(
                    f"tensor {name!r} in {reader.where(name)}: a {reader.dtype(name)} n-gram table is not supported yet"
                )
            shape = reader.shape(name)
            if len(shape) != 2 or shape[1] != self.dim:
                raise CheckpointError(
                    f"tensor {name!r} in {reader.where(name)} has shape {list(shape)}; expected [rows, {self.dim}]"
                )
            rows += shape[0]
        # transformers pads the table to make_ngram_vocab_size_divisible_by; a release may store it unpadded
        if not self.hasher.rows_needed <= rows <= self.hasher.table_rows:
            raise CheckpointError(
                f"PLE table {prefix!r} has {rows} rows; the config's hash needs {self.hasher.rows_needed} "
                f"(padded: {self.hasher.table_rows})"
            )
        self.mode = mode
        if mode == "resident":
            self.table = torch.cat([reader.get(n) for n in names]).to(device)
            return
        start = 0
        for name in names:
            part = _map_tensor(reader.file_of[name], name, self._maps)
            self.parts.append(MappedPart(start, part))
            start += part.shape[0]

    def allocate(self, rows: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A resident table of ``rows`` uninitialised rows, returned for the caller to fill (random-weight
        builds, which read no checkpoint)."""
        self.mode = "resident"
        self.table = torch.empty(rows, self.dim, dtype=dtype, device=device)
        return self.table

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            raise RuntimeError("the PLE n-gram table was not loaded")
        if self.mode == "resident":
            return F.embedding(row_ids, self.table).flatten(-2)
        flat = row_ids.flatten().cpu()
        out = torch.empty(flat.shape[0], self.dim, dtype=self.parts[0].rows.dtype)
        for part in self.parts:
            inside = (flat >= part.start) & (flat < part.start + part.rows.shape[0])
            out[inside] = part.rows[flat[inside] - part.start]
        return out.to(row_ids.device).view(*row_ids.shape, self.dim).flatten(-2)
