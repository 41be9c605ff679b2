"""bf12: the lossless 12-bit resident form of BF16 matrices (``engine.bf16_weights``).

Per weight: a sign+mantissa byte and a 4-bit exponent code relative to a per-row base exponent (window of
15 exponents, codes 0..14). Code 15 is an escape: the true bf16 bits sit in a per-row, column-sorted side
table of int32 ``(col << 16) | bits``. A row with more than 64 escapes is kept raw (bf16); when more than
1/8 of the rows would be raw the matrix is not packed at all (``encode_bf12`` returns None).

Byte layout per row: K/1024 super-blocks of 1536 B ``[sm A 512 | sm B 512 | exp 512]``. Lane l (0..31) owns
bytes 16l..16l+15 of each segment, i.e. the 32 columns 32l..32l+31 of the super-block: sm A holds columns
32l+j, sm B columns 32l+16+j, and exp byte 16l+j holds the code of column 32l+j (low nibble) and of
32l+16+j (high nibble). Decoding rebuilds the bf16 bits exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from dgpp.errors import CheckpointError
from dgpp.quant.format import QuantFormat, Shape

SUPER_BLOCK = 1024
SUPER_BYTES = 1536
ESCAPE = 15
MAX_ROW_ESCAPES = 64
MAX_RAW_ROW_FRACTION = 1 / 8


def _lane_columns() -> torch.Tensor:
    """Packed position p (0..1023) of the sm segments -> column within the super-block."""
    p = torch.arange(SUPER_BLOCK)
    half, q = p // 512, p % 512
    return 32 * (q // 16) + 16 * half + q % 16


_COLUMN_OF = _lane_columns()


def _check_k(k: int) -> None:
    if k % SUPER_BLOCK or k > 65536:
        raise CheckpointError(f"bf12 needs in_features % 1024 == 0 and <= 65536 (got {k})")


def encode_bf12(weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Pack a BF16 [N, K] matrix; None when too many rows would stay raw (the matrix stays BF16)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise TypeError(f"bf12 packs 2-D bfloat16 matrices, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    _check_k(k)
    bits = weight.view(torch.int16).to(torch.int32) & 0xFFFF
    exp = (bits >> 7) & 0xFF
    sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
    # Base per row: the 15-exponent window holding the most weights (smallest base on ties).
    dev = weight.device
    hist = torch.zeros(n, 257, dtype=torch.int32, device=dev)
    hist[:, 1:].scatter_add_(1, exp.long(), torch.ones_like(exp))
    cum = hist.cumsum(1)
    bases = torch.arange(256 - 14, device=dev)
    in_window = cum[:, bases + 15] - cum[:, bases]
    base = in_window.argmax(1).to(torch.int32)
    code = exp - base[:, None]
    escaped = (code < 0) | (code > 14)
    code = torch.where(escaped, torch.full_like(code, ESCAPE), code)
    per_row = escaped.sum(1)
    raw = per_row > MAX_ROW_ESCAPES
    if raw.sum().item() > n * MAX_RAW_ROW_FRACTION:
        return None
    escaped &= ~raw[:, None]
    rows, cols = escaped.nonzero(as_tuple=True)  # row-major: columns sorted within each row
    escapes = (cols.to(torch.int64) << 16 | bits[rows, cols].to(torch.int64)).to(torch.int32)
    offsets = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    offsets[1:] = escaped.sum(1).cumsum(0)
    sb = k // SUPER_BLOCK
    cols_of = torch.arange(sb, device=dev)[:, None] * SUPER_BLOCK + _COLUMN_OF.to(dev)[None, :]  # [sb, 1024]
    sm_packed = sm[:, cols_of].to(torch.uint8)  # [n, sb, 1024]
    code_p = code[:, cols_of]
    exp_packed = (code_p[..., :512] | (code_p[..., 512:] << 4)).to(torch.uint8)
    packed = torch.cat((sm_packed, exp_packed), dim=-1).reshape(n, sb * SUPER_BYTES)
    raw_rows = raw.nonzero().flatten().to(torch.int32)
    return {
        "packed": packed,
        "base": base.to(torch.uint8),
        "escape_offsets": offsets,
        "escapes": escapes,
        "raw_rows": raw_rows,
        "raw": weight[raw_rows.long()].clone(),
    }


def decode_bf12_bits(tensors: dict[str, torch.Tensor], shape: Shape) -> torch.Tensor:
    """The exact bf16 bit patterns [N, K] as int32."""
    n, k = shape
    sb = k // SUPER_BLOCK
    packed = tensors["packed"].reshape(n, sb, SUPER_BYTES).to(torch.int32)
    sm_p = packed[..., :SUPER_BLOCK]
    e = packed[..., SUPER_BLOCK:]
    code_p = torch.cat((e & 0xF, e >> 4), dim=-1)
    exp_p = code_p + tensors["base"].to(torch.int32)[:, None, None]
    bits_p = ((sm_p & 0x80) << 8) | ((exp_p & 0xFF) << 7) | (sm_p & 0x7F)
    dev = packed.device
    bits = torch.empty(n, sb, SUPER_BLOCK, dtype=torch.int32, device=dev)
    bits[..., _COLUMN_OF.to(dev)] = bits_p
    bits = bits.reshape(n, k)
    offsets = tensors["escape_offsets"].long()
    counts = offsets[1:] - offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(n, device=dev), counts)
    entries = tensors["escapes"].to(torch.int64) & 0xFFFFFFFF
    bits[rows, entries >> 16] = (entries & 0xFFFF).to(torch.int32)
    raw_rows = tensors["raw_rows"].long()
    if raw_rows.numel():
        bits[raw_rows] = tensors["raw"].view(torch.int16).to(torch.int32) & 0xFFFF
    return bits


@dataclasses.dataclass(frozen=True)
class BF12(QuantFormat):
    """The bf12 resident form (derived at load from a BF16 weight, never shipped); decode is bit-exact BF16."""

    name = "bf12"

    def tensor_shapes(self, shape: Shape) -> dict[str, tuple[int, ...]]:
        n, k = shape
        _check_k(k)
        return {"packed": (n, k // SUPER_BLOCK * SUPER_BYTES), "base": (n,), "escape_offsets": (n + 1,)}

    def optional_tensors(self) -> tuple[str, ...]:
        return ("escapes", "raw_rows", "raw")

    def tensor_itemsize(self, name: str) -> int:
        return {"packed": 1, "base": 1, "raw": 2}.get(name, 4)

    def decode(self, tensors: dict[str, torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        bits = decode_bf12_bits(tensors, shape)
        bf16 = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)
        return bf16.to(dtype)
