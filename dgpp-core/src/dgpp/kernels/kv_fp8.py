"""The e4m3 row form of ``engine.kv_dtype: fp8``: quantize K/V rows on their way into the cache, dequantize tiles
on their way out.

A row is one token's one KV head (``head_dim`` values). It is stored as e4m3 codes ``round(x / scale)`` with one
fp32 ``scale = amax(|x|) / 448`` (448 is e4m3's largest finite value; an all-zero row keeps scale 0 and zero
codes), and read back as ``code * scale`` rounded to the compute dtype. Every reader (the torch paths here and
in ``dgpp.nn``, the Triton attention kernels) dequantizes with that one expression, once per loaded tile, so a
key's value never depends on which path or which step read it. Quantizing is row-local: a row's codes do not
depend on the other rows of its step, which keeps chunked prefill, batching and the prefix cache exact.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton
from dgpp.step.cache_spec import KV_FP8

E4M3_MAX = 448.0
KVScales = tuple[torch.Tensor, torch.Tensor] | None  # (k_scale, v_scale) of an e4m3 entry; None: not e4m3


def divide(x: torch.Tensor, constant: float) -> torch.Tensor:
    """``x / constant`` rounded once, on every device. torch's CUDA ``tensor / float`` multiplies by the float
    reciprocal instead (a bit can differ from the CPU's quotient); a tensor divisor divides on both, so a scale
    has the same bits on either device and in the Triton cache writer (``dgpp.kernels.quantized_write``)."""
    return x / torch.full_like(x, constant)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (e4m3 codes ``[..., D]``, fp32 scales ``[..., 1]``), one scale per last-axis row."""
    wide = x.float()
    scale = divide(wide.abs().amax(dim=-1, keepdim=True), E4M3_MAX)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (wide / divisor).clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``code * scale`` in fp32, rounded once to ``dtype`` (what the kernels compute per tile)."""
    return (codes.float() * scales).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a reader of its stored rows sees it (quantized, then dequantized to ``x``'s dtype)."""
    codes, scales = quantize_rows(x)
    return dequantize_rows(codes, scales, x.dtype)


@triton.jit
def dequantize_tile(codes, scale_ptr, rows, mask, dtype: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A loaded tile of e4m3 ``codes`` as ``code * scale`` rounded once to ``dtype``, the scales read at ``rows``
    (where ``mask``): one per column of a transposed key tile ``[D, N]``, else one per row of ``[N, D]``."""
    scale = tl.load(scale_ptr + rows, mask=mask, other=0.0)
    if TRANSPOSED:
        tile = (codes.to(tl.float32) * scale[None, :]).to(dtype)
    else:
        tile = (codes.to(tl.float32) * scale[:, None]).to(dtype)
    return tile


def e4m3_words(cache: torch.Tensor) -> torch.Tensor:
    """An e4m3 cache ``[..., D]`` as int32 words ``[..., D / 4]`` (code ``4w + i`` in byte ``i`` of word ``w``),
    what ``load_e4m3_rows`` reads; strides count words."""
    if cache.shape[-1] % 4 or cache.stride(-1) != 1:
        raise ValueError(
            f"e4m3 K/V rows are read as 4-code words: the head dim must be a multiple of 4 and contiguous, "
            f"got shape {tuple(cache.shape)} with strides {cache.stride()}"
        )
    return cache.view(torch.int32)


@triton.jit
def _e4m3_pairs(words):
    """Bytes 0 and 2 (``even``) and bytes 1 and 3 (``odd``) of each int32 word as the low and high fp16 lanes
    of a word, by bit placement instead of the conversion unit: the sign to the lane's bit 15 and the seven
    exponent/mantissa bits to bits 7..13, which reads as ``code * 2^-8`` (e4m3's subnormals land on fp16's).
    Two codes per 32-bit operation; the NaN codes (never written: rows are clamped to +-448) read as +-480."""
    even = ((words << 7) & 0x3F803F80) | ((words << 8) & -0x7FFF8000)  # -0x7FFF8000: the sign bits 0x80008000
    odd = ((words >> 1) & 0x3F803F80) | (words & -0x7FFF8000)
    return even, odd


@triton.jit
def _fp16_lane(pairs, HIGH: tl.constexpr):
    """The low (or ``HIGH``) 16 bits of each int32 as an fp16 value, widened to fp32 (exact)."""
    if HIGH:
        bits = (pairs >> 16).to(tl.int16)
    else:
        bits = pairs.to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_e4m3_rows(
    row_words,
    scale_ptr,
    rows,
    mask,
    width,
    dtype: tl.constexpr,
    BLOCK_W: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """The e4m3 rows at int32 pointers ``row_words [N]`` (code ``4w + i`` in byte ``i`` of word ``w``) as a tile
    of ``code * scale`` rounded once to ``dtype``, the values ``dequantize_tile`` gives: ``[N, 4 * BLOCK_W]``, or
    ``[4 * BLOCK_W, N]`` (a key tile for ``q @ k``) when ``TRANSPOSED``. The scales are read at ``rows`` where
    ``mask``; ``width`` words of each row are loaded. Whole words are loaded (the pipelined tile is read out of
    shared memory as words, not bytes) and decoded in registers."""
    w = tl.arange(0, BLOCK_W)
    if TRANSPOSED:
        words = tl.load(row_words[None, :] + w[:, None], mask=mask[None, :] & (w[:, None] < width), other=0)
        scale = tl.load(scale_ptr + rows, mask=mask, other=0.0)[None, :]
    else:
        words = tl.load(row_words[:, None] + w[None, :], mask=mask[:, None] & (w[None, :] < width), other=0)
        scale = tl.load(scale_ptr + rows, mask=mask, other=0.0)[:, None]
    even, odd = _e4m3_pairs(words)
    # (code * 2^-8) * (scale * 2^8) is code * scale rounded once: scale * 2^8 is exact, and finite for every
    # row scale (amax / 448 < 2^120)
    scale = scale * 256.0
    c0 = _fp16_lane(even, False) * scale
    c1 = _fp16_lane(odd, False) * scale
    c2 = _fp16_lane(even, True) * scale
    c3 = _fp16_lane(odd, True) * scale
    # [.., 2, 2] holding c(2a + j) at [.., a, j]: code 4w + 2a + j once the word axis and (a, j) are flattened
    tile = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    if TRANSPOSED:  # [W, N, 2, 2] -> [W, 2, 2, N]
        tile = tl.reshape(tl.permute(tile, (0, 2, 3, 1)), (4 * BLOCK_W, row_words.shape[0]))
    else:
        tile = tl.reshape(tile, (row_words.shape[0], 4 * BLOCK_W))
    return tile.to(dtype)
