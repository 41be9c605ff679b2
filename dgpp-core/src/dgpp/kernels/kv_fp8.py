"""The e4m3 row form of ``engine.kv_dtype: fp8``: quantize K/V rows on their way into the cache, read them back in
the attention.

A row is one token's one KV head (``head_dim`` values). It is stored as e4m3 codes ``round(x / scale)`` with one
fp32 ``scale = amax(|x|) / 448`` (448 is e4m3's largest finite value; an all-zero row keeps scale 0 and zero
codes). Quantizing is row-local: a row's codes do not depend on the other rows of its step, which keeps chunked
prefill, batching and the prefix cache exact. The readers:

- the torch paths (here and in ``dgpp.nn``), the prefill kernel (``dequantize_tile``) and the window kernel
  (``load_e4m3_rows``) compute ``code * scale`` in fp32 and round it once to the compute dtype, once per loaded
  tile, then attend over those values;
- the paged decode kernel (decode and verify rows, the sink families' split-context decode) applies the scale
  once per key instead of once per value (``load_e4m3_lanes`` and the scalings beside it): the dot products see
  the exact codes, the score of key ``j`` is multiplied by its K scale and its probability by its V scale before
  that is rounded for the P.V dot. One rounding fewer per value, so its output is not bit-equal to attention over
  the dequantized rows; it is a function of the row's own keys and of the split count alone, the same in every
  batch, graph or eager.

Each kernel reads a row the same way at every step, so a row's bits never depend on which step or batch read it.
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
    what ``load_e4m3_rows`` and ``load_e4m3_lanes`` read; strides count words."""
    if cache.shape[-1] % 4 or cache.stride(-1) != 1:
        raise ValueError(
            f"e4m3 K/V rows are read as 4-code words: the head dim must be a multiple of 4 and contiguous, "
            f"got shape {tuple(cache.shape)} with strides {cache.stride()}"
        )
    return cache.view(torch.int32)


@triton.jit
def _load_words(row_words, mask, width, BLOCK_W: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``width`` int32 words of each row at ``row_words [N]`` where ``mask``: ``[BLOCK_W, N]`` when ``TRANSPOSED``,
    else ``[N, BLOCK_W]``. Whole words are loaded (the pipelined tile is read out of shared memory as words, not
    bytes) and decoded in registers."""
    w = tl.arange(0, BLOCK_W)
    if TRANSPOSED:
        words = tl.load(row_words[None, :] + w[:, None], mask=mask[None, :] & (w[:, None] < width), other=0)
    else:
        words = tl.load(row_words[:, None] + w[None, :], mask=mask[:, None] & (w[None, :] < width), other=0)
    return words


@triton.jit
def _lane(pairs, lane_dtype: tl.constexpr, HIGH: tl.constexpr):
    """The low (or ``HIGH``) 16 bits of each int32 read as a ``lane_dtype`` value."""
    if HIGH:
        bits = (pairs >> 16).to(tl.int16)
    else:
        bits = pairs.to(tl.int16)
    return bits.to(lane_dtype, bitcast=True)


@triton.jit
def _tile_of_codes(c0, c1, c2, c3, n: tl.constexpr, BLOCK_W: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Code ``i`` of each word (``ci``, shaped like the words) put back in its column ``4w + i``."""
    # [.., 2, 2] holding c(2a + j) at [.., a, j]: code 4w + 2a + j once the word axis and (a, j) are flattened
    tile = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    if TRANSPOSED:  # [W, N, 2, 2] -> [W, 2, 2, N]
        tile = tl.reshape(tl.permute(tile, (0, 2, 3, 1)), (4 * BLOCK_W, n))
    else:
        tile = tl.reshape(tile, (n, 4 * BLOCK_W))
    return tile


@triton.jit
def _e4m3_fp16_pairs(words):
    """Bytes 0 and 2 (``even``) and bytes 1 and 3 (``odd``) of each int32 word as the low and high fp16 lanes
    of a word, by bit placement instead of the conversion unit: the sign to the lane's bit 15 and the seven
    exponent/mantissa bits to bits 7..13, which reads as ``code * 2^-8`` (e4m3's subnormals land on fp16's).
    Two codes per 32-bit operation; the NaN codes (never written: rows are clamped to +-448) read as +-480."""
    even = ((words << 7) & 0x3F803F80) | ((words << 8) & -0x7FFF8000)  # -0x7FFF8000: the sign bits 0x80008000
    odd = ((words >> 1) & 0x3F803F80) | (words & -0x7FFF8000)
    return even, odd


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
    ``mask``; ``width`` words of each row are loaded."""
    words = _load_words(row_words, mask, width, BLOCK_W, TRANSPOSED)
    scale = tl.load(scale_ptr + rows, mask=mask, other=0.0)
    if TRANSPOSED:
        scale = scale[None, :]
    else:
        scale = scale[:, None]
    even, odd = _e4m3_fp16_pairs(words)
    # (code * 2^-8) * (scale * 2^8) is code * scale rounded once: scale * 2^8 is exact, and finite for every
    # row scale (amax / 448 < 2^120)
    scale = scale * 256.0
    c0 = _lane(even, tl.float16, False).to(tl.float32) * scale
    c1 = _lane(odd, tl.float16, False).to(tl.float32) * scale
    c2 = _lane(even, tl.float16, True).to(tl.float32) * scale
    c3 = _lane(odd, tl.float16, True).to(tl.float32) * scale
    return _tile_of_codes(c0, c1, c2, c3, row_words.shape[0], BLOCK_W, TRANSPOSED).to(dtype)


# The folded read (``load_e4m3_lanes`` and the scalings below): a row's scale is one number per key, so it is
# applied to the score column (K) and to the probability column (V) of that key instead of to each of its D
# values; the codes reach the dot as exact bf16 values ``code * 2^-120``. The powers of two keep every value the
# tensor cores see normal and are taken back out exactly:
# - K: the query is lifted by 2^64 (finite for |q| < 2^64), so a product q * code * 2^-56 is normal for
#   |q * code| >= 2^-70; the score column is multiplied by ``k_scale * softmax_scale * 2^56``, finite for
#   k_scale < 2^72 (a row amax below 2^80).
# - V: probability p (<= 1) times ``v_scale * 2^100`` is rounded to bf16 for the P.V dot, finite for
#   v_scale < 2^27 (a row amax below 2^35); the accumulator holds the output times 2^-20 and is multiplied by
#   2^20 once a split is done. A p whose weighted value is below bf16's normal range (p * v_scale < 2^-226)
#   adds nothing a bf16 output could show.
# e4m3's subnormal codes (|code| < 2^-6, below 2^-15 of the row's amax) land on bf16 subnormals. fp16 compute
# takes fp16 lanes (``code * 2^-8``, exact), an unlifted query, ``k_scale * softmax_scale * 2^8`` per score
# column and ``v_scale * 2^8`` per probability column (at most 146 * 2^8 for an fp16 row), nothing to take out.
@triton.jit
def _e4m3_bf16_pairs(words):
    """Bytes 0 and 2 (``even``) and bytes 1 and 3 (``odd``) of each int32 word as the low and high bf16 lanes of
    a word: the sign to the lane's bit 15 and the seven exponent/mantissa bits to bits 4..10, which reads as
    ``code * 2^-120`` exactly (e4m3's exponent bias 7 against bf16's 127; the NaN codes, never written, read as
    +-480 * 2^-120)."""
    even = ((words << 4) & 0x07F007F0) | ((words << 8) & -0x7FFF8000)  # -0x7FFF8000: the sign bits 0x80008000
    odd = ((words >> 4) & 0x07F007F0) | (words & -0x7FFF8000)
    return even, odd


@triton.jit
def load_e4m3_lanes(
    row_words, mask, width, dtype: tl.constexpr, BLOCK_W: tl.constexpr, TRANSPOSED: tl.constexpr
):
    """The e4m3 rows at int32 pointers ``row_words [N]`` as four tiles ``(c0, c1, c2, c3)`` shaped like the words
    (``[BLOCK_W, N]`` when ``TRANSPOSED``, else ``[N, BLOCK_W]``): ``ci[w]`` is code ``4w + i`` as
    ``code * 2^-120`` in ``dtype`` (exact, no scale; ``code * 2^-8`` for fp16), zeros where not ``mask`` or past
    ``width`` words. An fp32 lane is the bf16 lane's bits followed by 16 zeros (the same value). A reader splits the query (and its output)
    the same way and runs one dot per code of a word: one tile joined from the four makes Triton 3.6 pick an MMA
    operand layout that repacks the query and the probabilities around every MMA (docs/benchmarks.md)."""
    words = _load_words(row_words, mask, width, BLOCK_W, TRANSPOSED)
    if dtype == tl.float16:  # fp16 lanes: code * 2^-8 (fp16's exponent range is too narrow for 2^-120)
        even, odd = _e4m3_fp16_pairs(words)
        c0 = _lane(even, tl.float16, False)
        c1 = _lane(odd, tl.float16, False)
        c2 = _lane(even, tl.float16, True)
        c3 = _lane(odd, tl.float16, True)
    elif dtype == tl.float32:
        even, odd = _e4m3_bf16_pairs(words)
        c0 = (even << 16).to(tl.float32, bitcast=True)
        c1 = (odd << 16).to(tl.float32, bitcast=True)
        c2 = (even & -0x10000).to(tl.float32, bitcast=True)  # -0x10000: the high lane 0xFFFF0000
        c3 = (odd & -0x10000).to(tl.float32, bitcast=True)
    else:
        even, odd = _e4m3_bf16_pairs(words)
        c0 = _lane(even, tl.bfloat16, False)
        c1 = _lane(odd, tl.bfloat16, False)
        c2 = _lane(even, tl.bfloat16, True)
        c3 = _lane(odd, tl.bfloat16, True)
    return c0, c1, c2, c3


@triton.jit
def tiles_in_columns(t0, t1, t2, t3):
    """Four ``[M, W]`` tiles as one ``[M, 4 * W]`` tile with ``ti[:, w]`` in column ``4w + i``: an output
    accumulated against the ``load_e4m3_lanes`` value tiles put back in column order."""
    return _tile_of_codes(t0, t1, t2, t3, t0.shape[0], t0.shape[1], False)


@triton.jit
def lift_query(q):
    """``q * 2^64`` in q's dtype (exact), the query ``load_e4m3_lanes`` key tiles are dotted with; an fp16 query
    as it is."""
    if q.dtype == tl.float16:
        lifted = q
    else:
        lifted = (q.to(tl.float32) * 18446744073709551616.0).to(q.dtype)
    return lifted


@triton.jit
def key_column_scales(k_scale_ptr, rows, mask, softmax_scale, dtype: tl.constexpr):
    """What the scores of a lifted query against ``load_e4m3_lanes`` keys are multiplied by, per key column:
    ``k_scale * softmax_scale * 2^56`` (``2^8`` for fp16; 0 where not ``mask``)."""
    k_scale = tl.load(k_scale_ptr + rows, mask=mask, other=0.0)
    if dtype == tl.float16:
        factor = softmax_scale * 256.0
    else:
        factor = softmax_scale * 72057594037927936.0
    return k_scale * factor


@triton.jit
def value_row_weights(v_scale_ptr, rows, mask, dtype: tl.constexpr):
    """``v_scale * 2^100`` per value row (``2^8`` for fp16, finite for every fp16 row: amax <= 65504; 0 where not
    ``mask``): the probability column weight for ``load_e4m3_lanes`` values; the accumulator then holds the
    output times 2^-20 (fp16: the output itself; ``unlift_output``)."""
    v_scale = tl.load(v_scale_ptr + rows, mask=mask, other=0.0)
    if dtype == tl.float16:
        weight = v_scale * 256.0
    else:
        weight = v_scale * 1.2676506002282294e30
    return weight


@triton.jit
def unlift_output(acc, dtype: tl.constexpr):
    """An accumulator of weighted probabilities against ``load_e4m3_lanes`` values, times 2^20 (exact; fp16: as
    it is)."""
    if dtype == tl.float16:
        out = acc
    else:
        out = acc * 1048576.0
    return out
