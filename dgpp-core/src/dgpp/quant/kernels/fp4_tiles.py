"""One K step of E2M1 weights for the packed decode GEMV: scaled (even columns, odd columns) tiles.

Two layouts, selectable per tile (``GemvTile.fp4_layout``) so one GPU sweep compares them:

* ``grouped`` (layout 0): bytes and scales addressed as [BN, groups, G/2] and [BN, groups, 1], so the group
  scale broadcasts inside each thread's registers; the decoded tiles are reshaped to [BN, BK/2].
* ``flat`` (layout 1): bytes as the 2-D [BN, BK/2] row segment they are in memory (16-byte loads), decoded
  elementwise in the loaded layout (no 3-D shape, no reshape, no join); scales either gathered per byte
  (``FP4_SCALES`` 0: addresses repeat G/2 times, L1 serves the repeats) or loaded once per group and
  broadcast through a reshape (``FP4_SCALES`` 1), or loaded as 32-bit words of four (``FP4_SCALES`` 2, async
  copies) and broadcast the same way.

The scales of a step are loaded by ``fp4_step_scales``, in the step or one step ahead (``quant_tile``).

Both return exact e2m1 × scale values in ``DOT_DTYPE``, × 2^-14 unless ``FAST`` (the inline-PTX decoder).
"""

from __future__ import annotations

from dgpp.kernels._triton import tl, triton
from dgpp.quant.kernels.e2m1_asm import e2m1_pairs


@triton.jit
def _e2m1_scaled(nib, DOT_DTYPE: tl.constexpr):
    """4-bit E2M1 codes (int16, 0..15) -> value × 2^-14 in ``DOT_DTYPE``, exactly, via fp16 bits."""
    bits = ((nib & 0x7) << 9) | ((nib & 0x8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(DOT_DTYPE)


@triton.jit
def scale_values(s, FMT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Stored group scales (uint8) -> values in ``DOT_DTYPE`` (exact: E4M3 and powers of two fit bf16)."""
    if FMT == 3:  # E8M0: 2^(s-127) built as fp32 bits; s == 0 is 2^-127, an fp32 subnormal
        s32 = s.to(tl.int32)
        sf = tl.where(s32 == 0, 5.877471754111438e-39, (s32 << 23).to(tl.float32, bitcast=True))
    else:
        sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return sf.to(DOT_DTYPE)


@triton.jit
def _nibbles(packed, FAST: tl.constexpr, DOT_DTYPE: tl.constexpr):
    if FAST:
        lo, hi = e2m1_pairs(packed, DOT_DTYPE)
    else:
        b = packed.to(tl.int16)
        lo = _e2m1_scaled(b & 0xF, DOT_DTYPE)
        hi = _e2m1_scaled(b >> 4, DOT_DTYPE)
    return lo, hi


@triton.jit
def fp4_step_scales(
    s_rows,
    col_ok,
    k0,
    k_hi,
    FMT: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN: tl.constexpr,
    LAYOUT: tl.constexpr,
    SCALES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """The group scales of the step at ``k0`` (``s_rows``: the program's rows of the [N, K/G] scales) as values in
    the dot dtype, shaped for the layout's decode: [BN, groups, 1] (grouped), [BN, BK/2] one per byte (flat,
    ``SCALES`` 0) or [BN, groups] (flat, ``SCALES`` 1 and 2). Byte loads are not turned into async copies, so a
    scale load used in its own step waits on the global memory latency every step: ``SCALES`` 2 loads 32-bit
    words of four scales instead (EVEN tiles of four or more groups per step; the bytes are taken apart in
    registers), which Triton's pipeline copies ahead asynchronously like the weights; ``quant_tile``'s
    ``SCALES_AHEAD`` calls this a step early instead."""
    GPS: tl.constexpr = BK // G
    offs_g = k0 // G + tl.arange(0, GPS)
    if LAYOUT == 0:
        ptrs = s_rows[:, :, None] + offs_g[None, :, None]
        ok = col_ok[:, None, None] & (offs_g < k_hi // G)[None, :, None]
    elif SCALES == 0:  # one address per byte; G/2 neighbours share it
        offs_b = k0 // 2 + tl.arange(0, BK // 2)
        ptrs = s_rows + (offs_b // (G // 2))[None, :]
        ok = col_ok[:, None] & (offs_b * 2 < k_hi)[None, :]
    else:
        ptrs = s_rows + offs_g[None, :]
        ok = col_ok[:, None] & (offs_g < k_hi // G)[None, :]
    if EVEN and LAYOUT == 1 and SCALES == 2 and GPS % 4 == 0:
        # whole 32-bit words of four scales: loads of 4 bytes or more become async copies, pipelined with the weights
        words = s_rows.to(tl.pointer_type(tl.int32)) + (k0 // (4 * G) + tl.arange(0, GPS // 4))[None, :]
        w = tl.load(words)
        shifts = 8 * tl.arange(0, 4)
        s = tl.reshape((w[:, :, None] >> shifts[None, None, :]) & 0xFF, (BN, GPS)).to(tl.uint8)
    elif EVEN:
        s = tl.load(ptrs)
    else:
        s = tl.load(ptrs, mask=ok, other=0)
    return scale_values(s, FMT, DOT_DTYPE)


@triton.jit
def fp4_weights(
    w_rows,
    s_rows,
    s_pre,
    col_ok,
    k0,
    k_hi,
    AHEAD: tl.constexpr,
    FMT: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN: tl.constexpr,
    FAST: tl.constexpr,
    LAYOUT: tl.constexpr,
    SCALES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """The step at ``k0`` as scaled (even columns, odd columns) tiles. Its scales are ``s_pre`` (values loaded a
    step ahead, ``AHEAD``) or loaded here after the bytes (``fp4_step_scales``).

    Layout 0: [BN, groups, G/2] bytes, the [BN, groups, 1] scales broadcast natively, then one reshape.
    Layout 1: the [BN, BK/2] bytes as stored, decoded where they were loaded; scales per byte (``SCALES`` 0) or
    per group, broadcast to its G/2 bytes (``SCALES`` 1, 2)."""
    HALF: tl.constexpr = BK // 2
    GPS: tl.constexpr = BK // G
    offs_g = k0 // G + tl.arange(0, GPS)
    if LAYOUT == 1:
        offs_b = k0 // 2 + tl.arange(0, HALF)  # byte index along the row
        ptrs = w_rows + offs_b[None, :]
        ok = col_ok[:, None] & (offs_b * 2 < k_hi)[None, :]
    else:
        offs_j = tl.arange(0, G // 2)
        ptrs = w_rows[:, :, None] + (offs_g * (G // 2))[None, :, None] + offs_j[None, None, :]
        ok = col_ok[:, None, None] & (offs_g < k_hi // G)[None, :, None]
    if EVEN:
        packed = tl.load(ptrs)
    else:
        packed = tl.load(ptrs, mask=ok, other=0)
    sf = s_pre
    if not AHEAD:
        sf = fp4_step_scales(s_rows, col_ok, k0, k_hi, FMT, G, BN, BK, EVEN, LAYOUT, SCALES, DOT_DTYPE)
    if LAYOUT == 1 and SCALES != 0:
        sf = tl.reshape(tl.broadcast_to(sf[:, :, None], (BN, GPS, G // 2)), (BN, HALF))
    lo, hi = _nibbles(packed, FAST, DOT_DTYPE)
    lo = lo * sf
    hi = hi * sf
    if LAYOUT == 0:
        lo = tl.reshape(lo, (BN, HALF))
        hi = tl.reshape(hi, (BN, HALF))
    return lo, hi
