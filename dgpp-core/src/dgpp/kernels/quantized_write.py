"""Quantize-on-write into the paged pool in one launch: a step's MLA latent rows (``engine.kv_dtype`` fp8 / fp4,
their ``k_rot`` rows stored as they are beside them), e4m3 DSA index keys and e4m3 K/V rows. Each row (one token's
one head) is quantized, and its codes and fp32 row scale stored at its slot.

The bytes are the torch encoder's (``dgpp.kernels.latent_formats.quantize_latent``, ``kv_fp8.quantize_rows``),
computed the same way: every division IEEE-rounded (``div_rn``; Triton's plain ``/`` is approximate on CUDA),
torch's ``c / x`` as ``(1 / x) · c`` (what ``Tensor.__rtruediv__`` computes), e4m3 rounding to nearest even with
subnormals as torch's conversion does it (integer arithmetic on the fp32 bits, so no fp8 conversion instruction is
needed), e2m1 codes by the same comparison edges. One program per row reads nothing but its own row, so a row's
bytes do not depend on the rest of its step; a slot of -1 (padding, a row not kept) stores nothing; nothing is
read back to the host, so a captured decode step can include it.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.kernels.latent_formats import latent_format_of, quantize_latent
from dgpp.step.cache_spec import FP4_BLOCK, KV_FP8


@triton.jit
def e4m3_code(v):
    """fp32 ``v`` -> its e4m3 byte (int32), nearest with ties to even; a magnitude of 480 or more gives NaN."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    # below 2^-6 the code is the magnitude in units of 2^-9 (exact: a power-of-two scale), rounded to an integer
    # by adding 2^23, where the fp32 spacing is 1
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    # above it: rebias the exponent (127 -> 7) and round the 23 mantissa bits to 3, the carry moving the exponent
    normal = ((magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) >> 20) - (120 << 3)
    # 0x3C800000: fp32 bits of 2^-6, e4m3's smallest normal; 0x43F00000: 480, from which on (inf, NaN too) torch
    # converts to NaN
    code = tl.where(magnitude_bits < 0x3C800000, subnormal, normal)
    code = tl.where(magnitude_bits >= 0x43F00000, 0x7F, code)
    return code | sign


@triton.jit
def _e4m3_value(code):
    """A non-negative e4m3 byte (int32) -> fp32 (0x7F, NaN, reads 480: callers mask it)."""
    normal = ((code << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    return tl.where(code < 8, code.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _clamp(v, bound):
    """``v`` clamped to ``[-bound, bound]``, NaN kept (as ``torch.clamp``)."""
    return tl.where(v > bound, bound, tl.where(v < -bound, -bound, v))


@triton.jit
def _e2m1_code(y):
    """fp32 ``y`` -> e2m1 code (sign in bit 3): nearest, ties to the even code, saturating at 6 (the edges of
    ``latent_formats.e2m1_codes``)."""
    m = tl.abs(y)
    code = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
    code += (
        (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    )
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _store_fp8_row(src, dst, scale_dst, width, keep, BLOCK: tl.constexpr):
    """e4m3 codes ``x / (amax / 448)`` (``kv_fp8.quantize_rows``) and the row scale."""
    offs = tl.arange(0, BLOCK)
    inside = offs < width
    x = tl.load(src + offs, mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.math.div_rn(amax, 448.0)
    codes = e4m3_code(_clamp(tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)), 448.0))
    tl.store(dst + offs, codes.to(tl.uint8), mask=inside & keep)
    tl.store(scale_dst, scale, mask=keep)


@triton.jit
def _store_fp4_row(src, dst, scale_dst, width, pad, keep, BLOCK_N: tl.constexpr):
    """Packed e2m1 codes in 16-value blocks, each block's e4m3 scale byte after the codes, zero padding, and the
    fp32 row scale ``amax / (6 · 448)`` (``latent_formats.quantize_fp4``)."""
    n_blocks = width // 16
    block = tl.arange(0, BLOCK_N)
    pair = tl.arange(0, 8)
    inside = block < n_blocks
    tile = block[:, None] * 16 + 2 * pair[None, :]
    even = tl.load(src + tile, mask=inside[:, None], other=0.0).to(tl.float32)
    odd = tl.load(src + tile + 1, mask=inside[:, None], other=0.0).to(tl.float32)
    block_amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    amax = tl.max(block_amax, axis=0)
    row_scale = tl.math.div_rn(amax, 2688.0)
    inverse = tl.where(amax > 0, tl.math.div_rn(1.0, tl.where(amax > 0, amax, 1.0)) * 448.0, 0.0)
    scale_code = e4m3_code(_clamp(block_amax * inverse, 448.0))
    block_scale = _e4m3_value(scale_code) * row_scale
    usable = (block_scale > 0) & (scale_code != 0x7F)  # torch: a NaN block scale fails "> 0"
    block_inverse = tl.where(usable, tl.math.div_rn(1.0, tl.where(usable, block_scale, 1.0)), 0.0)
    low = _e2m1_code(even * block_inverse[:, None])
    high = _e2m1_code(odd * block_inverse[:, None])
    store = inside & keep
    tl.store(dst + block[:, None] * 8 + pair[None, :], (low | (high << 4)).to(tl.uint8), mask=store[:, None])
    tl.store(dst + width // 2 + block, scale_code.to(tl.uint8), mask=store)
    padding = tl.arange(0, 16)
    zeros = tl.zeros([16], dtype=tl.uint8)
    tl.store(dst + width // 2 + n_blocks + padding, zeros, mask=(padding < pad) & keep)
    tl.store(scale_dst, row_scale, mask=keep)


@triton.jit
def _quantized_write_kernel(
    rows,
    rope,
    slots,
    codes,
    scales,
    rope_pool,
    width,
    rope_width,
    pad,
    row_stride,
    row_head,
    rope_stride,
    codes_slot,
    codes_head,
    scale_slot,
    scale_head,
    rope_slot,
    FP4: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots + row).to(tl.int64)
    keep = slot >= 0
    at = tl.where(keep, slot, 0)
    src = rows + row * row_stride + head * row_head
    dst = codes + at * codes_slot + head * codes_head
    scale_dst = scales + at * scale_slot + head * scale_head
    if FP4:
        _store_fp4_row(src, dst, scale_dst, width, pad, keep, BLOCK)
    else:
        _store_fp8_row(src, dst, scale_dst, width, keep, BLOCK)
    if BLOCK_R > 0:  # one head (a latent): its k_rot row, as it is
        offs = tl.arange(0, BLOCK_R)
        inside = (offs < rope_width) & keep
        value = tl.load(rope + row * rope_stride + offs, mask=inside)
        tl.store(rope_pool + at * rope_slot + offs, value.to(rope_pool.dtype.element_ty), mask=inside)


def write_quantized_triton(
    cache: torch.Tensor,
    row_scale: torch.Tensor,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_cache: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
) -> None:
    """Quantize ``rows`` ``[T, heads, width]`` (a row: one token's one head) to ``cache``'s form (e4m3 codes, or
    packed fp4 bytes) and store the codes, the fp32 row scales (``row_scale``, one per slot and head) and, for one
    head, ``k_rot`` ``[T, 1, rope]`` (into ``rope_cache``, as it is) at flat slots ``slot_mapping`` (-1: skip the
    token). Pools are contiguous: ``[blocks, rows_per_block, (heads,) width]``."""
    tokens, heads, width = rows.shape
    if not tokens:
        return
    fp4 = latent_format_of(cache) == "fp4"
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    # pools as [slots, heads, width] views (a flat slot is block * rows_per_block + offset): the stores land in them
    codes = cache.view(torch.uint8).view(-1, heads, cache.shape[-1])
    scales = row_scale.view(-1, heads, 1)
    rope_width = 0 if k_rot is None or rope_cache is None else k_rot.shape[-1]
    if k_rot is None or rope_cache is None or not rope_width:
        k_rot, rope = rows.view(tokens, -1), codes.view(codes.shape[0], -1)  # unread
    else:
        if heads != 1:
            raise ValueError(f"k_rot is stored beside one head's rows, not {heads}")
        k_rot = k_rot.reshape(tokens, rope_width)
        if k_rot.stride(-1) != 1:
            k_rot = k_rot.contiguous()
        rope = rope_cache.view(-1, rope_width)
    _quantized_write_kernel[(tokens, heads)](
        rows,
        k_rot,
        slot_mapping,
        codes,
        scales,
        rope,
        width,
        rope_width,
        cache.shape[-1] - (width // 2 + width // FP4_BLOCK) if fp4 else 0,
        rows.stride(0),
        rows.stride(1),
        k_rot.stride(0),
        codes.stride(0),
        codes.stride(1),
        scales.stride(0),
        scales.stride(1),
        rope.stride(0),
        FP4=fp4,
        BLOCK=next_pow2(width // FP4_BLOCK) if fp4 else next_pow2(width),
        BLOCK_R=next_pow2(rope_width) if rope_width else 0,
        num_warps=4,
    )


def write_quantized_ref(
    cache: torch.Tensor,
    row_scale: torch.Tensor,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_cache: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
) -> None:
    """The torch encoder, then the scatters: what ``write_quantized_triton`` stores."""
    stored, scale = quantize_latent(rows, latent_format_of(cache))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pairs = [(cache, stored), (row_scale, scale)]
    if rope_cache is not None and k_rot is not None and k_rot.shape[-1]:
        pairs.append((rope_cache, k_rot))
    for pool, new in pairs:
        # as bytes: torch's CPU index_put has no float8 kernel
        _bytes(pool).view(-1, *new.shape[1:])[slots] = _bytes(new[keep].to(pool.dtype))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t


def write_quantized(
    cache: torch.Tensor,
    row_scale: torch.Tensor,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_cache: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
) -> None:
    """Quantize and store a step's latent, index-key or K/V rows (in place); Triton on CUDA, torch elsewhere."""
    fn = write_quantized_triton if use_triton(rows) else write_quantized_ref
    fn(cache, row_scale, rows, slot_mapping, rope_cache, k_rot)
