"""What Qwen2-VL-style vision towers share, for a family's tower to compose.

Such a tower takes the pixel rows ``patches.patch_rows`` makes (one row per patch, ``merge²`` consecutive rows per
merge block), embeds them with a Conv3d whose stride equals its kernel (``PatchEmbed``, ``strided_conv``), and runs non-causal
attention within each image (``attention_per_image``) with a 2-D rotary embedding: half of each head's rotary
channels turn with the patch's row, half with its column (``axial_inv_freq``, ``axial_angles``,
``rotate_half``). ``TowerShape``, ``read_tower_sizes`` and ``axial_rope_theta`` read the ``vision_config`` keys these towers agree on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ConfigKeyReader(Protocol):
    """The part of a config-key reader (``dgpp.plugin_api.ConfigKeys``) these checks use."""

    def optional(self, key: str, kind: type, default: Any) -> Any: ...

    def positive(self, key: str, default: int | None = None) -> int: ...

    def name(self, key: str) -> str: ...

    def error(self, message: str) -> Exception: ...


@dataclass(frozen=True)
class TowerShape:
    """The sizes every such tower's ``vision_config`` gives (a family's frozen config dataclass extends it with its
    own) and what follows from them."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values in one pixel row: ``in_channels x temporal_patch_size x patch_size²``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def check_heads(self, keys: ConfigKeyReader) -> None:
        """The heads split ``hidden_size`` evenly, each into a multiple of 4 (two rotary axes of pairs)."""
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise keys.error(
                f"{keys.name('hidden_size')} = {self.hidden_size} must split into {self.num_heads} heads of a "
                "multiple of 4"
            )


def read_tower_sizes(keys: ConfigKeyReader, defaults: Mapping[str, int]) -> dict[str, int]:
    """``TowerShape``'s sizes from ``vision_config``, in field order: each a positive int, ``defaults[name]`` where
    the key is absent."""
    return {f.name: keys.positive(f.name, defaults[f.name]) for f in fields(TowerShape)}


def axial_rope_theta(keys: ConfigKeyReader) -> float:
    """``rope_parameters.rope_theta`` (10000 when absent); any ``rope_type`` but ``axial`` is refused by name."""
    rope = keys.optional("rope_parameters", dict, None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise keys.error(f"{keys.name('rope_parameters')}.rope_type must be 'axial'")
    return float(rope.get("rope_theta", 10000.0))


def merge_block_coordinates(grid_h: int, grid_w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each patch in the order the pixel rows come: merge blocks row-major, and within a
    block its ``merge x merge`` patches row-major."""
    rows = torch.arange(grid_h).view(grid_h // merge, merge, 1, 1).expand(-1, -1, grid_w // merge, merge)
    cols = torch.arange(grid_w).view(1, 1, grid_w // merge, merge).expand(grid_h // merge, merge, -1, -1)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def axial_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies of one axis: a quarter of the head's channels, ``theta^(-2i / (head_dim / 2))``."""
    spatial = head_dim // 2
    return 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)


def axial_angles(rows: torch.Tensor, cols: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[n, head_dim]`` fp32 rotary angles: ``[row·f | column·f]`` twice over the head."""
    device = inv_freq.device
    half = torch.cat([rows[:, None].to(device) * inv_freq, cols[:, None].to(device) * inv_freq], dim=-1)
    return torch.cat([half, half], dim=-1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 over the whole head (``cos``/``sin`` ``[n, head_dim]``), back in ``x``'s dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    partner = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + partner * sin[:, None]).to(x.dtype)


def attention_per_image(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """``[n, heads·head_dim]``: each image's patches (``lengths`` consecutive rows of ``[n, heads, head_dim]``)
    attend to every patch of the same image and to no other."""
    out = []
    for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        heads = [t.transpose(0, 1) for t in (qi, ki, vi)]  # [heads, n, head_dim]
        out.append(F.scaled_dot_product_attention(*heads).transpose(0, 1))
    return torch.cat(out).flatten(1)


def strided_conv(conv: nn.Conv2d | nn.Conv3d, rows: torch.Tensor) -> torch.Tensor:
    """A convolution whose stride equals its kernel over inputs already cut into kernel-sized rows: one product of
    each flattened row with the flattened kernel."""
    return F.linear(rows.to(conv.weight.dtype), conv.weight.flatten(1), conv.bias)


class PatchEmbed(nn.Module):
    """``patch_embed.proj``: the checkpoint's Conv3d (kernel = stride = one patch) over flattened pixel rows."""

    def __init__(self, cfg: TowerShape, dtype: torch.dtype) -> None:
        super().__init__()
        patch = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=patch, stride=patch, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return strided_conv(self.proj, pixels)
