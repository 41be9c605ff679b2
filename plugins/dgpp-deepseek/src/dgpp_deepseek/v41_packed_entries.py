"""DeepSeek-V4.1-Flash's compressed cache held packed, as the release stores it: 890 bytes per token per rank.

A kv source's pools (``dgpp_deepseek.v41_indexer.CompressorV41``) hold byte rows, not values:

- a main entry (``head_dim`` 512) as FP4 E2M1 with an E4M3 scale per 16 channels: 256 bytes of nibble pairs
  and 32 scale bytes, 288 per entry;
- an index key (``index_head_dim`` 128) as FP4 E2M1 with a power-of-two (E8M0) scale per 32: 64 + 4 = 68.

At the release's layer groups (three ratio-2 sources, one ratio-1) that is ``3 x (288 + 68) / 2 + 288 + 68
= 890`` bytes per token, against 3,200 for the same values held as BF16. Every layer's window ring (per request
state) holds its latents as FP8 E4M3 codes with an E8M0 scale per 32 (528 bytes a row, 1,024 in BF16); a
decode step on CUDA reads them in the attention kernel (``dgpp_deepseek.v41_decode``), other steps decode the
step's rings and pack them back after its rows join. A row's bytes are the nibbles first
(channel ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high one), then one scale byte per block.
Readers decode the entries they gather (``decode``) into exactly the values ``round_fp4_e4m3`` /
``round_fp4_e8m0`` give: the nibble times its block's scale is exact in fp32 and in bf16, so the logits are
the bits the value-rounded cache gave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dgpp.kernels.latent_formats import e2m1_values
from dgpp_deepseek.v41_latent_formats import fp4_e4m3_parts, fp4_e8m0_parts, fp8_e8m0_parts


class EntryFormat(Protocol):
    """How a compressed pool stores rows of ``dim`` values: ``width`` elements of ``dtype`` per row."""

    @property
    def width(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``[n, dim]`` values -> ``[n, width]`` stored rows."""
        ...

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[n, width]`` stored rows -> ``[n, dim]`` values in ``dtype``."""
        ...


@dataclass(frozen=True)
class PackedFP4:
    """E2M1 nibble pairs and one scale byte per ``block`` channels: E4M3 (``scale_kind="e4m3"``) or a power of
    two's biased exponent (``"e8m0"``, ``2^(byte - 127)``)."""

    dim: int
    block: int
    scale_kind: str

    @property
    def width(self) -> int:
        return self.dim // 2 + self.dim // self.block

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        if self.scale_kind == "e4m3":
            codes, scale = fp4_e4m3_parts(values, self.block)
            scale_bytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            codes, scale = fp4_e8m0_parts(values, self.block)
            exponent = torch.frexp(scale).exponent  # scale = 0.5 * 2^exponent
            scale_bytes = (exponent + 126).to(torch.uint8)
        nibbles = codes.flatten(-2)
        pairs = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        return torch.cat([pairs, scale_bytes.flatten(-2)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        half = self.dim // 2
        pairs, scale_bytes = rows[..., :half], rows[..., half:]
        nibbles = torch.stack([pairs & 15, pairs >> 4], dim=-1).flatten(-2)
        if self.scale_kind == "e4m3":
            scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
        else:
            scale = torch.ldexp(torch.ones_like(scale_bytes, dtype=torch.float32), scale_bytes.int() - 127)
        values = e2m1_values(nibbles).unflatten(-1, (-1, self.block)) * scale[..., None]
        return values.flatten(-2).to(dtype)


@dataclass(frozen=True)
class PackedFP8:
    """E4M3 codes (one byte per channel) and one power-of-two scale byte per ``block`` channels (``2^(byte -
    127)``): the window rings' form, in which the DSpark stages' context latents are held too (528 bytes per
    512-wide row). Encoding values already in this form gives them back unchanged."""

    dim: int
    block: int = 32

    @property
    def width(self) -> int:
        return self.dim + self.dim // self.block

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        codes, scale = fp8_e8m0_parts(values, self.block)
        exponent = torch.frexp(scale).exponent  # scale = 0.5 * 2^exponent
        scale_bytes = (exponent + 126).to(torch.uint8).flatten(-2)
        return torch.cat([codes.flatten(-2).view(torch.uint8), scale_bytes], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes, scale_bytes = rows[..., : self.dim].contiguous(), rows[..., self.dim :]
        scale = torch.ldexp(torch.ones_like(scale_bytes, dtype=torch.float32), scale_bytes.int() - 127)
        values = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, self.block)) * scale[..., None]
        return values.flatten(-2).to(dtype)


@dataclass
class EntryFormats:
    """The forms of one model's compressed pools and window rings, shared by every layer that writes or reads
    them."""

    main: EntryFormat
    index: EntryFormat
    window: EntryFormat

    @classmethod
    def release(cls, head_dim: int, index_head_dim: int) -> EntryFormats:
        """The release's: main entries FP4 + E4M3 per 16, index keys FP4 + E8M0 per 32, the window rings' latents
        FP8 + E8M0 per 32."""
        return cls(
            PackedFP4(head_dim, 16, "e4m3"), PackedFP4(index_head_dim, 32, "e8m0"), PackedFP8(head_dim)
        )
