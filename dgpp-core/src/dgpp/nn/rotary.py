"""Rotary position embeddings: rotate-half (NeoX) and interleaved (GPT-J) styles, partial rotary,
YaRN frequency scaling, and multimodal RoPE (mRoPE).

For text-only input every mRoPE section (temporal / height / width) carries the same position, so
the recomposed frequencies equal plain 1-D RoPE over ``rotary_dim``: text steps pass ``[T]`` positions. A step
with image tokens passes ``[axes, T]`` positions, and each section turns with its own axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import nn

from dgpp.kernels._triton import use_triton
from dgpp.kernels.trailing_rotary import trailing_rotary

RotaryStyle = Literal["half", "interleaved"]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (arXiv 2309.00071): interpolate low frequencies by ``factor``, keep high ones, ramp between."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # scales cos/sin; default 0.1·ln(factor)+1 (or the mscale ratio)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def magnitude(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor

        def yarn_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, base: float, dim: int) -> torch.Tensor:
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        extrapolated = 1.0 / base**exponents
        interpolated = extrapolated / self.factor

        def correction_dim(rotations: float) -> float:
            # the dimension index whose wavelength makes `rotations` turns over the original context
            return (
                dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep_extrapolated = 1.0 - ramp
        return interpolated * (1.0 - keep_extrapolated) + extrapolated * keep_extrapolated


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


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


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A config.json's RoPE (``rope_parameters``, or ``rope_theta`` + ``rope_scaling``) as
    ``dgpp.checkpoint.config_keys.ConfigKeys.rope`` reads it: ``theta``, the ``rope_type`` (one of
    ``ROPE_TYPES``) and that type's keys (``factor``; llama3's ``low_freq_factor`` / ``high_freq_factor`` /
    ``original_max_position``; yarn's ``YarnScaling``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 0
    yarn: YarnScaling | None = None


class TrailingRotary(nn.Module):
    """``rotate(x [T, heads, D], positions [T])``: interleaved RoPE of ``x[..., D - rotary_dim:]``, DeepSeek-V4's
    ``[nope | rope]`` head layout. Consecutive channel pairs (GPT-J style) of the trailing slice rotate, with plain
    RoPE on its sliding layers and a second base plus YaRN on its compressed layers. Its attention also rotates the
    output's rope slice BACK (``inverse=True``, the angle negated) at the query position: K == V, so each value
    carries its key's rotation, and undoing it at the query leaves every entry's contribution a function of the
    distance. cos/sin are computed in fp32 and rounded to the activation dtype (``fp32_angles``: kept in fp32, as
    DeepSeek-V4.1-Flash's original kernels do); the rotation runs in fp32 and is rounded once, the reference's
    order."""

    def __init__(
        self, rotary_dim: int, base: float, *, yarn: YarnScaling | None = None, fp32_angles: bool = False
    ) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even")
        self.rotary_dim, self.fp32_angles = rotary_dim, fp32_angles
        inv_freq = yarn.inv_freq(base, rotary_dim) if yarn else default_inv_freq(base, rotary_dim)
        self.magnitude = yarn.magnitude() if yarn else 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        *,
        inverse: bool = False,
        head_rms_eps: float | None = None,
    ) -> torch.Tensor:
        """``x`` turned; with ``head_rms_eps``, each head scaled by its unweighted RMS first (the factor
        ``rsqrt(mean(x²) + eps)`` in fp32, rounded to ``x``'s dtype, then the product)."""
        if use_triton(x) and x.dim() == 3 and x.stride(-1) == 1:  # one launch, the same math
            inv_freq = self.inv_freq.to(x.device)
            return trailing_rotary(
                x,
                positions,
                inv_freq,
                self.magnitude,
                fp32_angles=self.fp32_angles,
                inverse=inverse,
                head_rms_eps=head_rms_eps,
            )
        if head_rms_eps is not None:
            x = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + head_rms_eps).to(x.dtype)
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, rotary_dim/2]
        angle_dtype = torch.float32 if self.fp32_angles else x.dtype
        cos = (freqs.cos() * self.magnitude).to(angle_dtype).float().repeat_interleave(2, dim=-1)[:, None, :]
        sin = (freqs.sin() * self.magnitude).to(angle_dtype).float().repeat_interleave(2, dim=-1)[:, None, :]
        if inverse:
            sin = -sin
        nope, rope = x[..., : -self.rotary_dim], x[..., -self.rotary_dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        turned = torch.stack((-odd, even), dim=-1).flatten(-2)
        return torch.cat((nope, (rope * cos + turned * sin).to(x.dtype)), dim=-1)


@overload
def rotary_embedding(
    rope: RopeScaling,
    head_dim: int,
    rotary_dim: int | None = None,
    *,
    style: RotaryStyle = "half",
    mrope_section: tuple[int, ...] | None = None,
    mrope_interleaved: bool = False,
    trailing: Literal[False] = False,
) -> RotaryEmbedding: ...


@overload
def rotary_embedding(
    rope: RopeScaling,
    head_dim: int,
    rotary_dim: int | None = None,
    *,
    style: RotaryStyle = "half",
    mrope_section: tuple[int, ...] | None = None,
    mrope_interleaved: bool = False,
    trailing: Literal[True],
    fp32_angles: bool = False,
) -> TrailingRotary: ...


def rotary_embedding(
    rope: RopeScaling,
    head_dim: int,
    rotary_dim: int | None = None,
    *,
    style: RotaryStyle = "half",
    mrope_section: tuple[int, ...] | None = None,
    mrope_interleaved: bool = False,
    trailing: bool = False,
    fp32_angles: bool = False,
) -> RotaryEmbedding | TrailingRotary:
    """The one RoPE factory: a ``RotaryEmbedding`` with the frequencies of ``rope.rope_type``. ``yarn`` is
    ``YarnScaling``; ``linear`` and ``llama3`` only rescale the inverse frequencies. ``mrope_section``: a
    multimodal RoPE's sections, validated against ``rotary_dim`` (text positions make it plain RoPE; ``[axes, T]``
    positions turn each section with its axis, ``mrope_interleaved`` sections alternating frequency by frequency).
    ``trailing``: a ``TrailingRotary`` instead, interleaved RoPE on the LAST ``rotary_dim``
    dims of each head (DeepSeek-V4's ``[nope | rope]`` layout; ``style`` must be ``interleaved``; ``fp32_angles``
    keeps its cos/sin in fp32)."""
    rotary: RotaryEmbedding | TrailingRotary
    if trailing:
        if style != "interleaved" or mrope_section is not None:
            raise ValueError("a trailing rotary is interleaved and has no mrope_section")
        dim = head_dim if rotary_dim is None else rotary_dim
        if dim > head_dim:
            raise ValueError(f"rotary_dim {dim} must be at most head_dim {head_dim}")
        rotary = TrailingRotary(dim, rope.theta, yarn=rope.yarn, fp32_angles=fp32_angles)
    else:
        if fp32_angles:
            raise ValueError("fp32_angles applies to a trailing rotary only")
        rotary = RotaryEmbedding(
            head_dim,
            rotary_dim,
            rope.theta,
            style=style,
            yarn=rope.yarn,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
        )
    if rope.rope_type in ("linear", "llama3"):
        inv_freq = default_inv_freq(rope.theta, rotary.rotary_dim)
        if rope.rope_type == "linear":
            inv_freq = inv_freq / rope.factor
        else:
            inv_freq = llama3_inv_freq(
                inv_freq, rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position
            )
        rotary.inv_freq.copy_(inv_freq)
    return rotary


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """The rotation partner of every dim: ``[x2, x1]`` for ``[x1, x2]`` (rotate-half style)."""
    return x.roll(x.shape[-1] // 2, dims=-1)


def _swap_pairs(x: torch.Tensor) -> torch.Tensor:
    """The rotation partner of every dim: ``(odd, even)`` for each ``(even, odd)`` pair (interleaved style)."""
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def _signed_sin(sin: torch.Tensor, style: RotaryStyle) -> torch.Tensor:
    """``sin`` with the rotation's minus sign folded in: ``x * cos + partner(x) * signed_sin`` is the rotation,
    bit for bit the ``x * cos + rotate_half(x) * sin`` of the references (``(-a) * b == a * (-b)`` exactly)."""
    if style == "half":
        first, second = sin.chunk(2, dim=-1)
        return torch.cat((-first, second), dim=-1)
    return torch.stack((-sin[..., 0::2], sin[..., 1::2]), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` dims of each head of q and k (``[T, heads, head_dim]``).

    cos/sin are computed in fp32 from the positions and cast to the activation dtype before the
    rotation, matching the HF reference's rounding in bf16.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int | None = None,
        base: float = 10000.0,
        *,
        style: RotaryStyle = "half",
        yarn: YarnScaling | None = None,
        mrope_section: tuple[int, ...] | None = None,
        mrope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {head_dim}")
        if mrope_section is not None and 2 * sum(mrope_section) != self.rotary_dim:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must sum to rotary_dim/2 = {self.rotary_dim // 2}"
            )
        self.style = style
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved
        inv_freq = yarn.inv_freq(base, self.rotary_dim) if yarn else default_inv_freq(base, self.rotary_dim)
        self.magnitude = yarn.magnitude() if yarn else 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cos_sin_memo: tuple | None = None  # (positions, (versions, dtype), (cos, sin)): see cos_sin
        self._factors_memo: tuple | None = None  # (cos, sin, factors): see rotation_factors

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, rotary_dim]`` cos and sin laid out for this style.

        On the CPU the last step's pair is kept: a model's layers share one module and one positions tensor
        per step, so the angles are computed once a step instead of once a layer (a new or changed positions
        tensor, or another dtype, computes afresh; the runner builds a fresh positions tensor every step, and
        inference tensors carry no version to check). CUDA keeps no memo (a graph capture must record the work)."""
        versions = tuple(None if t.is_inference() else t._version for t in (positions, self.inv_freq))
        memo, key = self._cos_sin_memo, (versions, dtype)
        if memo is not None and memo[0] is positions and memo[1] == key:
            return memo[2]
        freqs = self._freqs(positions)
        if self.style == "half":
            angles = torch.cat((freqs, freqs), dim=-1)
        else:
            angles = freqs.repeat_interleave(2, dim=-1)
        pair = (angles.cos() * self.magnitude).to(dtype), (angles.sin() * self.magnitude).to(dtype)
        if positions.device.type == "cpu":
            self._cos_sin_memo = (positions, key, pair)
        return pair

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, rotary_dim/2]`` angles of ``positions``: ``[T]`` (one axis), or ``[axes, T]`` for a multimodal RoPE,
        whose frequency ``i`` turns with axis ``a``'s position when ``i`` is in section ``a``: interleaved
        (``i % 3 == a`` while ``i < 3·section[a]``, else axis 0) or in consecutive runs of ``section[a]``."""
        inv_freq = self.inv_freq.to(positions.device)
        if positions.dim() == 1:
            return positions.float()[:, None] * inv_freq[None, :]
        if self.mrope_section is None or positions.shape[0] != len(self.mrope_section):
            raise ValueError(
                f"positions of shape {tuple(positions.shape)} need a multimodal RoPE with that many sections"
            )
        per_axis = positions.float()[:, :, None] * inv_freq  # [axes, T, rotary_dim/2]
        index = torch.arange(inv_freq.shape[0], device=positions.device)
        axis = torch.zeros_like(index)
        if self.mrope_interleaved:
            for a, size in enumerate(self.mrope_section[1:], start=1):
                axis[(index % 3 == a) & (index < 3 * size)] = a
        else:
            axis = torch.repeat_interleave(
                torch.arange(len(self.mrope_section), device=positions.device),
                torch.tensor(self.mrope_section, device=positions.device),
            )
        return per_axis.gather(0, axis.view(1, 1, -1).expand(1, per_axis.shape[1], -1))[0]

    def rotation_factors(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin``'s pair as ``_rotate`` multiplies it: ``[T, 1, rotary_dim]`` cos and ``_signed_sin``; on the
        CPU kept with the step's pair (the same tensors), so every layer of a step reuses them."""
        memo = self._factors_memo
        if memo is not None and memo[0] is cos and memo[1] is sin:
            return memo[2]
        factors = cos[:, None, :], _signed_sin(sin, self.style)[:, None, :]
        if sin.device.type == "cpu":
            self._factors_memo = (cos, sin, factors)
        return factors

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, head_dim]`` rotated by ``cos_sin``'s pair."""
        return self._rotate(x, *self.rotation_factors(cos, sin))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:  # the whole head turns: no slices to take or join
            partner = _swap_halves(x) if self.style == "half" else _swap_pairs(x)
            return x * cos + partner * signed_sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        partner = _swap_halves(rot) if self.style == "half" else _swap_pairs(rot)
        return torch.cat((rot * cos + partner * signed_sin, rest), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:  # one Triton launch for q and k, angles computed in fp32 in the kernel
            from dgpp import kernels

            return kernels.apply_rotary(
                q, k, positions, self.inv_freq, self.magnitude, is_neox=self.style == "half"
            )
        cos, sin = self.cos_sin(positions, q.dtype)
        # q's and k's heads rotated as one tensor: half the small ops of a decode row (the rotation is per element)
        both = self._rotate(torch.cat((q, k), dim=1), *self.rotation_factors(cos, sin))
        q_rot, k_rot = torch.split_with_sizes(both, [q.shape[1], k.shape[1]], dim=1)
        return q_rot, k_rot
