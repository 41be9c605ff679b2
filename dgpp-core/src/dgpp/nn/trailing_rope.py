"""Interleaved RoPE on the LAST ``rotary_dim`` dims of each head (DeepSeek-V4's ``[nope | rope]`` head layout).

DeepSeek-V4 rotates consecutive channel pairs (GPT-J style) of the trailing slice only, with plain RoPE on its
sliding layers and a second base plus YaRN on its compressed layers. Its attention also rotates the output's
rope slice BACK (``inverse=True``, the angle negated) at the query position: K == V, so each value carries its
key's rotation, and undoing it at the query leaves every entry's contribution a function of the distance.
cos/sin are computed in fp32 and rounded to the activation dtype, the rotation runs in fp32 and is rounded
once, the reference's order.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.nn.rotary import YarnScaling, default_inv_freq


class TrailingRotary(nn.Module):
    """``rotate(x [T, heads, D], positions [T])``: interleaved RoPE of ``x[..., D - rotary_dim:]``."""

    def __init__(self, rotary_dim: int, base: float, *, yarn: YarnScaling | None = None) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even")
        self.rotary_dim = rotary_dim
        inv_freq = yarn.inv_freq(base, rotary_dim) if yarn else default_inv_freq(base, rotary_dim)
        self.magnitude = yarn.magnitude() if yarn else 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, rotary_dim/2]
        cos = (freqs.cos() * self.magnitude).to(x.dtype).float().repeat_interleave(2, dim=-1)[:, None, :]
        sin = (freqs.sin() * self.magnitude).to(x.dtype).float().repeat_interleave(2, dim=-1)[:, None, :]
        if inverse:
            sin = -sin
        nope, rope = x[..., : -self.rotary_dim], x[..., -self.rotary_dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        turned = torch.stack((-odd, even), dim=-1).flatten(-2)
        return torch.cat((nope, (rope * cos + turned * sin).to(x.dtype)), dim=-1)
