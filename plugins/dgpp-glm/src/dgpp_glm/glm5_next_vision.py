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

from dgpp.nn.linear import Linear
from dgpp.nn.norm import RMSNorm
from dgpp.plugin_api import ConfigKeys, ProcessedImage


@dataclass(frozen=True)
class Glm5NextVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    projection_intermediate_size: int
    swiglu_limit: float
    rms_norm_eps: float
    attention_bias: bool
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values in one pixel row: ``in_channels x temporal_patch_size x patch_size²``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_config(cls, vision: Mapping[str, Any]) -> Glm5NextVisionConfig:
        """``config.json``'s ``vision_config``; a value this tower cannot run is a ConfigError naming the key."""
        keys = ConfigKeys(dict(vision), "config.json", prefix="vision_config.")
        rope = keys.optional("rope_parameters", dict, None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise keys.error(f"{keys.name('rope_parameters')}.rope_type must be 'axial'")
        if keys.optional("hidden_act", str, "silu") != "silu":
            raise keys.error(f"{keys.name('hidden_act')} must be 'silu' (the tower's SwiGLU)")
        cfg = cls(
            depth=keys.positive("depth", 24),
            hidden_size=keys.positive("hidden_size", 1024),
            intermediate_size=keys.positive("intermediate_size", 4096),
            num_heads=keys.positive("num_heads", 16),
            in_channels=keys.positive("in_channels", 3),
            patch_size=keys.positive("patch_size", 14),
            temporal_patch_size=keys.positive("temporal_patch_size", 2),
            spatial_merge_size=keys.positive("spatial_merge_size", 2),
            out_hidden_size=keys.positive("out_hidden_size", 1536),
            projection_intermediate_size=keys.positive("projection_intermediate_size", 10240),
            swiglu_limit=keys.optional("swiglu_limit", float, 10.0),
            rms_norm_eps=keys.optional("rms_norm_eps", float, 1e-5),
            attention_bias=keys.optional("attention_bias", bool, True),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise keys.error(
                f"{keys.name('hidden_size')} = {cfg.hidden_size} must split into {cfg.num_heads} heads of a "
                "multiple of 4"
            )
        return cfg


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def patch_coordinates(grid_h: int, grid_w: int, merge: int) -> torch.Tensor:
    """``[2, grid_h·grid_w]`` (row, column) of each patch in pixel-row order: merge blocks row-major over the grid,
    the ``merge x merge`` patches of a block row-major inside it."""
    rows = torch.arange(grid_h).view(-1, 1).expand(grid_h, grid_w)
    cols = torch.arange(grid_w).view(1, -1).expand(grid_h, grid_w)
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    return torch.stack([t.reshape(shape).permute(0, 2, 1, 3).flatten() for t in (rows, cols)])


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
        q, k = _rotate(self.q_norm(q), cos, sin), _rotate(self.k_norm(k), cos, sin)
        out = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            heads = [t.transpose(0, 1) for t in (qi, ki, vi)]  # [heads, n, head_dim]
            out.append(F.scaled_dot_product_attention(*heads).transpose(0, 1))  # within one image, no mask
        return self.proj(torch.cat(out).flatten(1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 over the whole head (``cos``/``sin`` ``[n, head_dim]``), back in ``x``'s dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    partner = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + partner * sin[:, None]).to(x.dtype)


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


def strided_conv(conv: nn.Conv2d | nn.Conv3d, rows: torch.Tensor) -> torch.Tensor:
    """A convolution whose stride equals its kernel over inputs already cut into kernel-sized rows: one product of
    each flattened row with the flattened kernel."""
    return F.linear(rows.to(conv.weight.dtype), conv.weight.flatten(1), conv.bias)


class PatchEmbed(nn.Module):
    """``patch_embed.proj``: the checkpoint's Conv3d (kernel = stride = one patch) over flattened pixel rows."""

    def __init__(self, cfg: Glm5NextVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        patch = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=patch, stride=patch, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return strided_conv(self.proj, pixels)


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
        spatial = cfg.head_dim // 2
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotary(self, grids: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per patch the cos/sin of its rotary angles: ``[row·f | column·f]`` twice over the head."""
        inv = self.inv_freq
        angles = []
        for t, h, w in grids:
            rows, cols = patch_coordinates(h, w, self.cfg.spatial_merge_size).to(inv.device).float()
            half = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)
            angles.append(torch.cat([half, half], dim=-1).repeat(t, 1))
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
