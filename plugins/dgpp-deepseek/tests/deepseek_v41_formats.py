"""DeepSeek-V4.1-Flash's packed formats, decoded and encoded from their bit-level definitions, plus a raw
safetensors reader and writer. Nothing here uses torch's float8 casts or any dgpp decoder: the values come
from the bit fields, so the model's own decoders can be checked against these.

Formats (the release's ``quantization_config``: ``quant_method fp8``, ``scale_fmt ue8m0``,
``weight_block_size [32, 32]``, ``expert_dtype fp4``):

- E8M0 (``F8_E8M0``): a byte ``s`` is ``2^(s - 127)``; 255 is NaN.
- E4M3 (``F8_E4M3``, the OCP ``e4m3fn``): sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0;
  exponent 0 is subnormal (``m/8 * 2^-6``); ``S.1111.111`` is NaN; no infinities. Largest finite 448.
- E2M1 (one nibble): sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0: ``{0, .5, 1, 1.5, 2, 3, 4, 6}``.
- FP8 block weights: ``X.weight`` E4M3 ``[N, K]`` and ``X.scale`` E8M0 ``[ceil(N/32), ceil(K/32)]``;
  ``W[n, k] = e4m3(code) * 2^(scale[n // 32, k // 32] - 127)``.
- MXFP4 expert weights: ``X.weight`` I8 ``[N, K/2]`` (column ``2j`` in the low nibble, ``2j + 1`` in the
  high one) and ``X.scale`` E8M0 ``[N, K/32]``; ``W[n, k] = e2m1(nibble) * 2^(scale[n, k // 32] - 127)``.
- Engram table rows: ``engram.embed.weight`` E4M3 ``[rows, head_dim]`` and ``engram.embed.scale`` E8M0
  ``[rows, head_dim/32]``; ``row[r, c] = e4m3(code) * 2^(scale[r, c // 32] - 127)``.

The encoders pick the smallest power-of-two scale that maps the block's absolute maximum onto the format's
largest finite value (448 for E4M3, 6 for E2M1) and round to nearest, ties to the even code.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

F64 = torch.float64
BLOCK = 32  # the FP8 weights' 32 x 32 scale blocks, the MXFP4 and Engram rows' 32-element groups
E4M3_MAX = 448.0
E2M1_MAX = 6.0


def _e4m3_value(b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    exp, man = (b >> 3) & 0xF, b & 7
    if exp == 0xF and man == 7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def _e2m1_value(c: int) -> float:
    sign = -1.0 if c & 8 else 1.0
    exp, man = (c >> 1) & 3, c & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


E4M3_TABLE = torch.tensor([_e4m3_value(b) for b in range(256)], dtype=F64)
E2M1_TABLE = torch.tensor([_e2m1_value(c) for c in range(16)], dtype=F64)
E8M0_TABLE = torch.tensor([math.nan if b == 255 else 2.0 ** (b - 127) for b in range(256)], dtype=F64)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    return E4M3_TABLE[codes.to(torch.uint8).long()]


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    return E8M0_TABLE[codes.to(torch.uint8).long()]


def decode_e2m1(nibbles: torch.Tensor) -> torch.Tensor:
    return E2M1_TABLE[nibbles.long()]


def _expand_rows_cols(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]


def decode_fp8_block(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes ``[N, K]`` (uint8) with E8M0 scales ``[ceil(N/32), ceil(K/32)]`` -> float64 ``[N, K]``."""
    n, k = weight.shape
    if tuple(scale.shape) != (-(-n // BLOCK), -(-k // BLOCK)):
        raise ValueError(f"FP8 block scale shape {tuple(scale.shape)} does not fit a [{n}, {k}] weight")
    return decode_e4m3(weight) * _expand_rows_cols(decode_e8m0(scale), n, k)


def unpack_e2m1_pairs(packed: torch.Tensor) -> torch.Tensor:
    """I8/U8 ``[N, K/2]`` -> nibble codes ``[N, K]`` (the low nibble is the even column)."""
    b = packed.to(torch.uint8).long() if packed.dtype != torch.int8 else packed.view(torch.uint8).long()
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def decode_mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``[N, K/2]`` byte pairs with E8M0 scales ``[N, K/32]`` -> float64 ``[N, K]``."""
    values = decode_e2m1(unpack_e2m1_pairs(weight))
    if values.shape[1] != scale.shape[1] * BLOCK or values.shape[0] != scale.shape[0]:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not fit a {tuple(values.shape)} weight"
        )
    return values * decode_e8m0(scale).repeat_interleave(BLOCK, dim=1)


def decode_engram_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Engram table rows: E4M3 ``[rows, D]`` with E8M0 ``[rows, D/32]`` -> float64 ``[rows, D]``."""
    if weight.shape[1] != scale.shape[1] * BLOCK or weight.shape[0] != scale.shape[0]:
        raise ValueError(f"Engram scale shape {tuple(scale.shape)} does not fit {tuple(weight.shape)} rows")
    return decode_e4m3(weight) * decode_e8m0(scale).repeat_interleave(BLOCK, dim=1)


# ---- encoders (the fixture's packing) ---------------------------------------------------------------------------


def pow2_scale_exponent(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The E8M0 exponent ``ceil(log2(amax / fmax))`` (exact: frexp), amax floored to one subnormal step."""
    ratio = amax.clamp_min(2.0**-126) / fmax
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-127, 127)


def _nearest_code(values: torch.Tensor, positive: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """The code of the nearest value of a format whose positive codes ``0..len(positive)-1`` increase with
    their value: round to nearest, ties to the even code; the sign bit set on a nonzero negative result."""
    mag = values.abs()
    hi = torch.searchsorted(positive, mag.contiguous()).clamp(1, positive.numel() - 1)
    lo = hi - 1
    d_lo, d_hi = mag - positive[lo], positive[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    negative = (values < 0) & (code != 0)
    return (code | (negative.long() * sign_bit)).to(torch.uint8)


def encode_e4m3(values: torch.Tensor) -> torch.Tensor:
    return _nearest_code(values.clamp(-E4M3_MAX, E4M3_MAX), E4M3_TABLE[:127], 0x80)


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    return _nearest_code(values.clamp(-E2M1_MAX, E2M1_MAX), E2M1_TABLE[:8], 0x8)


def encode_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (E4M3 codes uint8 ``[N, K]``, E8M0 scales uint8 ``[ceil(N/32), ceil(K/32)]``)."""
    n, k = w.shape
    pn, pk = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
    padded = torch.zeros(pn, pk, dtype=F64)
    padded[:n, :k] = w.to(F64)
    amax = padded.abs().unflatten(0, (-1, BLOCK)).unflatten(-1, (-1, BLOCK)).amax(dim=(1, 3))
    exp = pow2_scale_exponent(amax, E4M3_MAX)
    scale = torch.exp2(exp.to(F64))
    codes = encode_e4m3(w.to(F64) / _expand_rows_cols(scale, n, k))
    return codes, (exp + 127).to(torch.uint8)


def _encode_row_blocks(w: torch.Tensor, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = w.to(F64).unflatten(-1, (-1, BLOCK))
    exp = pow2_scale_exponent(blocks.abs().amax(-1), fmax)
    scaled = blocks / torch.exp2(exp.to(F64)).unsqueeze(-1)
    return scaled.flatten(-2), (exp + 127).to(torch.uint8)


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (I8 ``[N, K/2]`` byte pairs, E8M0 uint8 ``[N, K/32]``)."""
    scaled, scale = _encode_row_blocks(w, E2M1_MAX)
    codes = encode_e2m1(scaled).long()
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scale


def encode_engram_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[rows, D]`` -> (E4M3 codes uint8 ``[rows, D]``, E8M0 uint8 ``[rows, D/32]``)."""
    scaled, scale = _encode_row_blocks(w, E4M3_MAX)
    return encode_e4m3(scaled), scale


# ---- raw safetensors --------------------------------------------------------------------------------------------

_ITEM_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
_ITEM_BYTES.update({"F8_E4M3": 1, "F8_E8M0": 1})
_TORCH_VIEW = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
}


@dataclass(frozen=True)
class RawTensor:
    """One stored tensor: its safetensors dtype name, shape and bytes (uint8, flat)."""

    dtype: str
    shape: tuple[int, ...]
    data: torch.Tensor

    def codes(self) -> torch.Tensor:
        """The bytes as uint8 in the tensor's shape (the 1-byte packed dtypes)."""
        if _ITEM_BYTES[self.dtype] != 1:
            raise ValueError(f"{self.dtype} is not a one-byte dtype")
        return self.data.view(self.shape)

    def to_f64(self) -> torch.Tensor:
        """A plain float or integer tensor as float64 (exact for BF16 / F16 / F32)."""
        view = _TORCH_VIEW.get(self.dtype)
        if view is None:
            raise ValueError(f"{self.dtype} is a packed dtype: decode it with its format")
        return self.data.view(view).view(self.shape).to(F64)


def read_safetensors(path: str | Path) -> dict[str, RawTensor]:
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    body = torch.frombuffer(bytearray(blob[8 + n :]), dtype=torch.uint8)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        out[name] = RawTensor(meta["dtype"], tuple(meta["shape"]), body[start:end].clone())
    return out


def write_safetensors(path: str | Path, tensors: dict[str, RawTensor]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        size = math.prod(t.shape) * _ITEM_BYTES[t.dtype]
        if t.data.numel() != size:
            raise ValueError(f"{name}: {t.data.numel()} bytes for {t.dtype} {t.shape}")
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        chunks.append(t.data.numpy().tobytes())
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def raw(t: torch.Tensor, dtype: str) -> RawTensor:
    """A torch tensor as stored bytes: ``dtype`` names the safetensors dtype (one-byte codes pass as uint8)."""
    if _ITEM_BYTES[dtype] == 1:
        data = t.contiguous().view(torch.uint8) if t.dtype == torch.int8 else t.to(torch.uint8)
    else:
        data = t.to(_TORCH_VIEW[dtype]).contiguous().view(torch.uint8)
    return RawTensor(dtype, tuple(t.shape), data.flatten().clone())
