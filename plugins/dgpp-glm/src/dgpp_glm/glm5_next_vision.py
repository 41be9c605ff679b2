"""The vision tower of GLM-5.3-Flash (``glm5_next``'s ``vision_config``, checkpoint prefix ``model.visual.``).

Pixels arrive as rows of ``in_channels x temporal_patch_size x patch_size²`` values (``glm5_next_images``), one
row per patch, ``spatial_merge_size²`` consecutive rows per merge block. Each row is projected (the checkpoint's
Conv3d, whose stride equals its kernel, is one matrix product), then ``depth`` non-causal pre-RMSNorm blocks:
attention within one image with per-head q/k RMSNorm and a 2-D rotary embedding on the patch's (row, column), and a
SwiGLU MLP whose gate is clamped above and whose up projection is clamped both ways at ``swiglu_limit``. Then a
final RMSNorm, each merge block's patches folded into one row (``downsample``, a Conv2d whose stride equals its
kernel, again one matrix product) and the merger: ``proj`` -> LayerNorm -> GELU -> the clamped SwiGLU, out to the
text model's hidden size. One output row per placeholder token.
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
    strided_conv,
)
from dgpp.nn.linear import Linear
from dgpp.nn.norm import RMSNorm
from dgpp.plugin_api import ConfigKeys, ProcessedImage

# the shared sizes' defaults, where vision_config is silent
_SIZE_DEFAULTS = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 1536,
}


@dataclass(frozen=True)
class Glm5NextVisionConfig(TowerShape):
    """The tower's ``vision_config``: the shared sizes, then this tower's own."""

    projection_intermediate_size: int
    swiglu_limit: float
    rms_norm_eps: float
    attention_bias: bool
    rope_theta: float

    @classmethod
    def from_hf_config(cls, vision: Mapping[str, Any]) -> Glm5NextVisionConfig:
        """``config.json``'s ``vision_config``; a value this tower cannot run is a ConfigError naming the key."""
        keys = ConfigKeys(dict(vision), "config.json", prefix="vision_config.")
        rope_theta = axial_rope_theta(keys)
        if keys.optional("hidden_act", str, "silu") != "silu":
            raise keys.error(f"{keys.name('hidden_act')} must be 'silu' (the tower's SwiGLU)")
        cfg = cls(
            **read_tower_sizes(keys, _SIZE_DEFAULTS),
            projection_intermediate_size=keys.positive("projection_intermediate_size", 10240),
            swiglu_limit=keys.optional("swiglu_limit", float, 10.0),
            rms_norm_eps=keys.optional("rms_norm_eps", float, 1e-5),
            attention_bias=keys.optional("attention_bias", bool, True),
            rope_theta=rope_theta,
        )
        cfg.check_heads(keys)
        return cfg


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class VisionAttention(nn.Module):
    def __init__(self, cfg: Glm5NextVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=bias, dtype=dtype)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate_half(self.q_norm(q), cos, sin), rotate_half(self.k_norm(k), cos, sin)
        return self.proj(attention_per_image(q, k, v, lengths))


class VisionMLP(nn.Module):
    """``down(swiglu(gate(x), up(x)))`` with the tower's clamps; the merger's SwiGLU is the same (no biases)."""

    def __init__(self, width: int, inner: int, limit: float, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(width, inner, bias=bias, dtype=dtype)
        self.up_proj = Linear(width, inner, bias=bias, dtype=dtype)
        self.down_proj = Linear(inner, width, bias=bias, dtype=dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Glm5NextVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = VisionAttention(cfg, dtype)
        self.mlp = VisionMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, cfg.attention_bias, dtype
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class VisionMerger(VisionMLP):
    """``proj`` -> LayerNorm -> GELU (exact) -> the clamped SwiGLU; every projection without bias."""

    def __init__(self, cfg: Glm5NextVisionConfig, dtype: torch.dtype) -> None:
        width = cfg.out_hidden_size
        super().__init__(width, cfg.projection_intermediate_size, cfg.swiglu_limit, False, dtype)
        self.proj = Linear(width, width, bias=False, dtype=dtype)
        self.post_projection_norm = nn.LayerNorm(width, eps=1e-5, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class Glm5NextVisionTower(nn.Module):
    """Pixel rows of one or more images -> one embedding row per placeholder token, image after image."""

    def __init__(self, cfg: Glm5NextVisionConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        merge = cfg.spatial_merge_size
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.downsample = nn.Conv2d(
            cfg.hidden_size, cfg.out_hidden_size, kernel_size=merge, stride=merge, dtype=dtype
        )
        self.merger = VisionMerger(cfg, dtype)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", axial_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def _rotary(self, grids: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per patch the cos/sin of its rotary angles: ``[row·f | column·f]`` twice over the head."""
        angles = []
        for t, h, w in grids:
            rows, cols = merge_block_coordinates(h, w, self.cfg.spatial_merge_size)
            angles.append(axial_angles(rows, cols, self.inv_freq).repeat(t, 1))
        angle = torch.cat(angles)
        return angle.cos(), angle.sin()

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, ...]]) -> torch.Tensor:
        """``pixels`` ``[patches, patch_values]`` of the images whose ``(t, h, w)`` patch grids are ``grids``."""
        x = self.patch_embed(pixels)
        cos, sin = self._rotary(grids)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        x = self.post_layernorm(x)
        # a merge block's patches are consecutive rows; the Conv2d kernel reads them channel-major
        merge = self.cfg.spatial_merge_size
        blocks = x.view(-1, merge * merge, x.shape[-1]).transpose(1, 2).flatten(1)
        return self.merger(strided_conv(self.downsample, blocks))

    def encode(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """Each image's embedding rows ``[num_tokens, out_hidden_size]``, all images in one pass."""
        device = self.inv_freq.device
        out = self(torch.cat([im.pixels for im in images]).to(device), [im.grid for im in images])
        return list(out.split([im.num_tokens for im in images]))
