"""What a GGUF architecture is in HF terms: its config.json (from ``<arch>.*`` metadata) and its tensor
names (llama.cpp's ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight``).

Which architectures there are is the family plugins' knowledge: each offers its maps
(``dgpp_gguf_architectures``, a ``dgpp.offers.GGUFArchitecture``); any other ``general.architecture`` is
refused by name. llama.cpp's converter reorders the rows of the q and k projections of rotary models (per head,
the two rotary halves are interleaved so its kernels can rotate adjacent pairs); ``unpermute_rows`` puts the
rows a map names back into HF's rotate-half order. A family plugin then loads the converted checkpoint like any
other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from dgpp.catalog import gguf_architectures
from dgpp.checkpoint.gguf_file import GGUFFile
from dgpp.errors import CheckpointError
from dgpp.offers import GGUFArchitecture

_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows ``(pair i, half h)`` go back to ``(half h, pair i)``.

    Works for a weight ``[heads * head_dim, in]`` and a bias ``[heads * head_dim]``.
    """
    rows = weight.shape[0]
    half = rows // heads // 2
    rest = weight.shape[1:]
    return weight.reshape(heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def architecture(gguf: GGUFFile) -> GGUFArchitecture:
    """The installed plugins' map for the file's ``general.architecture``; an unmapped one is refused by name."""
    arch = gguf.require("general.architecture")
    known = gguf_architectures()
    if arch not in known:
        raise CheckpointError(
            f"{gguf.path}: general.architecture {arch!r} is not supported for GGUF checkpoints "
            f"(supported: {', '.join(sorted(known)) or 'none: no installed plugin maps a GGUF architecture'})"
        )
    return known[arch]


def hf_tensor_name(gguf: GGUFFile, arch: GGUFArchitecture, name: str) -> str:
    """The HF name of GGUF tensor ``name``; an unknown one is refused by name."""
    block = _BLOCK_NAME.match(name)
    if block and block.group(2) in arch.block_names:
        return f"model.layers.{block.group(1)}.{arch.block_names[block.group(2)]}.{block.group(3)}"
    glob = _GLOBAL_NAME.match(name)
    if glob and glob.group(1) in arch.global_names:
        return f"{arch.global_names[glob.group(1)]}.{glob.group(2)}"
    raise CheckpointError(f"{gguf.path}: tensor {name!r} has no mapping for architecture {arch.name!r}")


def _hf_rows(
    tensor: torch.Tensor, hf_name: str, arch: GGUFArchitecture, config: dict[str, Any]
) -> torch.Tensor:
    """``tensor`` (a weight's rows, decoded or as raw blocks) with interleaved rows back in HF order."""
    module = hf_name.rsplit(".", 1)[0]
    for suffix, heads_key in arch.interleaved_rows.items():
        if module.endswith(f".{suffix}") or module == suffix:
            return unpermute_rows(tensor, config[heads_key])
    return tensor


def hf_tensors(
    gguf: GGUFFile, arch: GGUFArchitecture, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the file, interleaved rows back in HF order."""
    for name in gguf.tensor_names():
        hf_name = hf_tensor_name(gguf, arch, name)
        yield hf_name, _hf_rows(gguf.tensor(name), hf_name, arch, config)


def hf_blocks(
    gguf: GGUFFile, arch: GGUFArchitecture, config: dict[str, Any]
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield ``(hf_name, ggml type, raw blocks [rows, bytes])`` for every block-quant tensor of the file, rows in
    the order ``hf_tensors`` gives them (a row's blocks stay whole: llama.cpp's reorder moves whole rows)."""
    for name in gguf.tensor_names():
        rows = gguf.blocks(name)
        if rows is not None:
            hf_name = hf_tensor_name(gguf, arch, name)
            yield hf_name, gguf.type_name(name), _hf_rows(rows, hf_name, arch, config)
