"""Llama's rotary embedding: dgpp's rotate-half ``RotaryEmbedding`` with the frequencies of the config's
``rope_type``. ``yarn`` is dgpp's own ``YarnScaling``; ``linear`` and ``llama3`` only rescale the inverse
frequencies, so they are computed here and written into the shared module's ``inv_freq``.
"""

from __future__ import annotations

import math

import torch

from dgpp.nn.rotary import RotaryEmbedding, YarnScaling, default_inv_freq
from dgpp_llama.config import LlamaConfig


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths longer than ``original / low_freq_factor`` are divided by ``factor``,
    shorter than ``original / high_freq_factor`` kept, and the band between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = original_max_position / low_freq_factor
    short_wavelen = original_max_position / high_freq_factor
    scaled = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(medium, blended, scaled)


def build_rotary(cfg: LlamaConfig) -> RotaryEmbedding:
    rope = cfg.rope
    if cfg.rope_type == "yarn":
        yarn = YarnScaling(
            factor=rope["factor"],
            original_max_position=rope["original_max_position"],
            beta_fast=rope.get("beta_fast", 32.0),
            beta_slow=rope.get("beta_slow", 1.0),
            attention_factor=rope.get("attention_factor"),
            mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"),
            truncate=rope["truncate"],
        )
        return RotaryEmbedding(cfg.head_dim, cfg.head_dim, cfg.rope_theta, style="half", yarn=yarn)
    rotary = RotaryEmbedding(cfg.head_dim, cfg.head_dim, cfg.rope_theta, style="half")
    inv_freq = default_inv_freq(cfg.rope_theta, cfg.head_dim)
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif cfg.rope_type == "llama3":
        inv_freq = llama3_inv_freq(
            inv_freq,
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position"],
        )
    rotary.inv_freq.copy_(inv_freq)
    return rotary
