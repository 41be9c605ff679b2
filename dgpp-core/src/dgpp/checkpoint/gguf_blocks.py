"""Decode GGUF (ggml) tensor data to torch: the float types and the 32-element block quants Q8_0, Q4_0, Q4_1.

Block layouts (ggml's ``block_q8_0`` / ``block_q4_0`` / ``block_q4_1``), little-endian, 32 weights each:

- Q8_0: fp16 scale ``d``, 32 int8 ``q``;                       w = d * q
- Q4_0: fp16 ``d``, 16 bytes of nibbles;                       w = d * (nibble - 8)
- Q4_1: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles;           w = d * nibble + m

Byte ``j`` of the nibbles holds weight ``j`` in its low half and weight ``j + 16`` in its high half.
Scales are widened to fp32 and the product (and the sum, for Q4_1) is rounded to fp32 as two separate
operations, which is what ggml's reference dequantizer computes, so the result is exact: every decoded
weight is the one value the block encodes. K-quants and the i-quants are not decoded (yet): they are
refused by name.
"""

from __future__ import annotations

import numpy as np
import torch

from dgpp.errors import CheckpointError

BLOCK = 32
# ggml type name -> bytes per 32-weight block
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED = (*FLOAT_TYPES, *BLOCK_BYTES)


def _fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as an fp32 column ``[n, 1]``."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes -> ``[n, 32]`` values 0..15: low halves are weights 0..15, high halves 16..31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def q8_0_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks ``[n, 34]`` -> ``(q [n, 32] int8, d [n, 1] fp32)``."""
    return blocks[:, 2:34].contiguous().view(torch.int8), _fp16_field(blocks, 0)


def q4_1_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks ``[n, 20]`` -> ``(q [n, 32] uint8 codes 0..15, d [n, 1] fp32, m [n, 1] fp32)``."""
    return _nibbles(blocks[:, 4:20]), _fp16_field(blocks, 0), _fp16_field(blocks, 2)


def decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q, d = q8_0_fields(blocks)
    return d * q.float()


def q4_0_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 blocks ``[n, 18]`` -> ``(q [n, 32] uint8 codes 0..15, d [n, 1] fp32)``."""
    return _nibbles(blocks[:, 2:18]), _fp16_field(blocks, 0)


def decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q, d = q4_0_fields(blocks)
    return d * (q.float() - 8.0)


def decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q, d, m = q4_1_fields(blocks)
    return d * q.float() + m


_DECODERS = {"Q8_0": decode_q8_0, "Q4_0": decode_q4_0, "Q4_1": decode_q4_1}


def _raw_bytes(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(raw).view(np.uint8).reshape(-1))  # a copy: the file's map is read-only


def block_rows(raw: np.ndarray, type_name: str, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """The raw 32-weight blocks of block-quant tensor ``what`` as ``[rows, blocks a row * block bytes]`` uint8
    (a row of ``shape``'s last dimension per row), checked against its type and shape like ``decode_tensor``."""
    if type_name not in BLOCK_BYTES:
        raise CheckpointError(
            f"{what}: ggml type {type_name} is not supported (dgpp decodes {', '.join(SUPPORTED)}; "
            "K-quants and i-quants are not yet supported)"
        )
    numel = int(np.prod(shape)) if shape else 1
    if numel % BLOCK or (shape and shape[-1] % BLOCK):
        raise CheckpointError(
            f"{what}: {type_name} rows of {shape[-1]} weights are not whole 32-weight blocks"
        )
    data, block_bytes = _raw_bytes(raw), BLOCK_BYTES[type_name]
    if data.numel() != numel // BLOCK * block_bytes:
        raise CheckpointError(
            f"{what}: {type_name} data holds {data.numel()} bytes, expected {numel // BLOCK * block_bytes}"
        )
    width = shape[-1] if shape else BLOCK
    return data.reshape(numel // width, width // BLOCK * block_bytes)


def decode_blocks(rows: torch.Tensor, type_name: str) -> torch.Tensor:
    """``block_rows``' ``[rows, bytes]`` decoded to fp32 ``[rows, weights]`` (exact)."""
    block_bytes = BLOCK_BYTES[type_name]
    return _DECODERS[type_name](rows.reshape(-1, block_bytes)).reshape(rows.shape[0], -1)


def decode_tensor(raw: np.ndarray, type_name: str, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """The tensor ``what`` of ggml type ``type_name`` and (row-major) ``shape`` from its raw bytes.

    Float types keep their dtype; block quants decode to fp32 (exact). Anything else is a
    ``CheckpointError`` naming the tensor and the type.
    """
    if type_name in FLOAT_TYPES:
        numel = int(np.prod(shape)) if shape else 1
        data, dtype = _raw_bytes(raw), FLOAT_TYPES[type_name]
        expected = numel * torch.finfo(dtype).bits // 8
        if data.numel() != expected:
            raise CheckpointError(f"{what}: {type_name} data holds {data.numel()} bytes, expected {expected}")
        return data.view(dtype).reshape(shape)
    return decode_blocks(block_rows(raw, type_name, shape, what), type_name).reshape(shape)
