"""The vision tower of Qwen3.8-Flash-Next (``qwen4_exp``'s ``vision_config``, checkpoint prefix ``model.visual.``).

Pixels arrive as rows of ``in_channels x temporal_patch_size x patch_size²`` values (``qwen4_exp_images``), four
consecutive rows per ``spatial_merge_size²`` block. Each row is projected (the checkpoint's Conv3d, whose stride
equals its kernel, is one matrix product), gets the learned square position table bilinearly resampled to the
image's patch grid, then ``depth`` non-causal pre-LayerNorm blocks (attention within one image, 2-D rotary on the
patch's row and column) and the merger: LayerNorm, then each block of four rows concatenated and projected
through ``fc1 -> GELU -> fc2`` to the text model's hidden size. One output row per placeholder token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.media.tower import (
    PatchEmbed,
    TowerShape,
    attention_per_image,
    axial_angles,
    axial_inv_freq,
    axial_rope_theta,
    merge_block_coordinates,
    read_tower_sizes,
    rotate_half,
)
from dgpp.nn.linear import Linear
from dgpp.plugin_api import ConfigKeys, ProcessedImage

_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}

# the shared sizes' defaults, where vision_config is silent
_SIZE_DEFAULTS = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 3584,
}


@dataclass(frozen=True)
class VisionConfig(TowerShape):
    """The tower's ``vision_config``: the shared sizes, then this tower's own."""

    num_position_embeddings: int
    rope_theta: float
    hidden_act: str

    @classmethod
    def from_hf_config(cls, vision: Mapping[str, Any]) -> VisionConfig:
        """``config.json``'s ``vision_config``; a value this tower cannot run is a ConfigError naming the key."""
        keys = ConfigKeys(dict(vision), "config.json", prefix="vision_config.")
        rope_theta = axial_rope_theta(keys)
        act = keys.optional("hidden_act", str, "gelu_pytorch_tanh")
        if act not in _ACTIVATIONS:
            raise keys.error(f"{keys.name('hidden_act')} = {act!r} is not one of {', '.join(_ACTIVATIONS)}")
        cfg = cls(
            **read_tower_sizes(keys, _SIZE_DEFAULTS),
            num_position_embeddings=keys.positive("num_position_embeddings", 2304),
            rope_theta=rope_theta,
            hidden_act=act,
        )
        side = int(cfg.num_position_embeddings**0.5)
        if side * side != cfg.num_position_embeddings:
            raise keys.error(f"{keys.name('num_position_embeddings')} must be a square number")
        cfg.check_heads(keys)
        return cfg


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Corner-aligned bilinear taps of ``index`` (of ``size``) into a table axis of ``side``: indices and weights."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    low = torch.floor(src)
    taps = low.long()[:, None] + torch.arange(2)
    weights = (1 - (src[:, None] - low[:, None] - torch.arange(2)).abs()).clamp(min=0)
    return taps.clamp(0, side - 1), weights


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True, dtype=dtype)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        return self.proj(attention_per_image(q, k, v, lengths))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype)
        self.approximate = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6, dtype=dtype)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6, dtype=dtype)
        self.attn = VisionAttention(cfg, dtype)
        self.mlp = VisionMLP(cfg, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class VisionMerger(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6, dtype=dtype)
        self.linear_fc1 = Linear(self.width, self.width, bias=True, dtype=dtype)
        self.linear_fc2 = Linear(self.width, cfg.out_hidden_size, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.width))))


class Qwen4ExpVisionTower(nn.Module):
    """Pixel rows of one or more images -> one embedding row per placeholder token, image after image."""

    def __init__(self, cfg: VisionConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.depth))
        self.merger = VisionMerger(cfg, dtype)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", axial_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def _positions(self, grids: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per patch: the resampled learned position embedding, and the rotary cos/sin of its (row, column)."""
        cfg, side = self.cfg, int(self.cfg.num_position_embeddings**0.5)
        embeds, angles = [], []
        for t, h, w in grids:
            rows, cols = merge_block_coordinates(h, w, cfg.spatial_merge_size)
            row_taps, row_weights = _bilinear_taps(rows, h, side)
            col_taps, col_weights = _bilinear_taps(cols, w, side)
            index = (row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1)
            weight = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
            table = self.pos_embed(index.to(self.pos_embed.weight.device))
            embeds.append((table * weight.to(table.device)[:, :, None]).sum(1).repeat(t, 1))
            angles.append(axial_angles(rows, cols, self.inv_freq).repeat(t, 1))
        angle = torch.cat(angles)
        return torch.cat(embeds), angle.cos(), angle.sin()

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, ...]]) -> torch.Tensor:
        """``pixels`` ``[patches, patch_values]`` of the images whose ``(t, h, w)`` patch grids are ``grids``."""
        x = self.patch_embed(pixels)
        pos, cos, sin = self._positions(grids)
        x = x + pos.to(x.dtype)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def encode(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """Each image's embedding rows ``[num_tokens, out_hidden_size]``, all images in one pass."""
        device = self.pos_embed.weight.device
        out = self(torch.cat([im.pixels for im in images]).to(device), [im.grid for im in images])
        return list(out.split([im.num_tokens for im in images]))
