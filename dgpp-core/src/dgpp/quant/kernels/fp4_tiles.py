"""One K step of E2M1 weights for the packed decode GEMV: scaled (even columns, odd columns) tiles.

Two layouts, selectable per tile (``GemvTile.fp4_layout``) so one GPU sweep compares them:

* ``grouped`` (layout 0): bytes and scales addressed as [BN, groups, G/2] and [BN, groups, 1], so the group
  scale broadcasts inside each thread's registers; the decoded tiles are reshaped to [BN, BK/2].
* ``flat`` (layout 1): bytes as the 2-D [BN, BK/2] row segment they are in memory (16-byte loads), decoded
  elementwise in the loaded layout (no 3-D shape, no reshape, no join); scales either gathered per byte
  (``FP4_SCALES`` 0: addresses repeat G/2 times, L1 serves the repeats) or loaded once per group and
  broadcast through a reshape (``FP4_SCALES`` 1).

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
def fp4_grouped_weights(
    w_rows,
    s_ptr,
    cols,
    col_ok,
    k0,
    k_dim,
    k_hi,
    FMT: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN: tl.constexpr,
    FAST: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Layout 0: [BN, groups, G/2] bytes, the [BN, groups, 1] scale broadcast natively, then one reshape."""
    GPS: tl.constexpr = BK // G
    groups = k_dim // G
    offs_g = k0 // G + tl.arange(0, GPS)
    offs_j = tl.arange(0, G // 2)
    ptrs = w_rows[:, :, None] + (offs_g * (G // 2))[None, :, None] + offs_j[None, None, :]
    s_ptrs = s_ptr + cols[:, None, None].to(tl.int64) * groups + offs_g[None, :, None]
    if EVEN:
        packed = tl.load(ptrs)
        s = tl.load(s_ptrs)
    else:
        g_ok = (offs_g < k_hi // G)[None, :, None]
        packed = tl.load(ptrs, mask=col_ok[:, None, None] & g_ok, other=0)
        s = tl.load(s_ptrs, mask=col_ok[:, None, None] & g_ok, other=0)
    sf = scale_values(s, FMT, DOT_DTYPE)
    lo, hi = _nibbles(packed, FAST, DOT_DTYPE)
    return tl.reshape(lo * sf, (BN, BK // 2)), tl.reshape(hi * sf, (BN, BK // 2))


@triton.jit
def fp4_flat_weights(
    w_rows,
    s_ptr,
    cols,
    col_ok,
    k0,
    k_dim,
    k_hi,
    FMT: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN: tl.constexpr,
    FAST: tl.constexpr,
    SCALES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Layout 1: the [BN, BK/2] bytes as stored, decoded where they were loaded."""
    HALF: tl.constexpr = BK // 2
    offs_b = k0 // 2 + tl.arange(0, HALF)  # byte index along the row
    s_rows = s_ptr + cols[:, None].to(tl.int64) * (k_dim // G)
    if EVEN:
        packed = tl.load(w_rows + offs_b[None, :])
    else:
        ok = col_ok[:, None] & (offs_b * 2 < k_hi)[None, :]
        packed = tl.load(w_rows + offs_b[None, :], mask=ok, other=0)
    if SCALES == 0:  # one load per byte; G/2 neighbours share an address
        s_ptrs = s_rows + (offs_b // (G // 2))[None, :]
        if EVEN:
            s = tl.load(s_ptrs)
        else:
            s = tl.load(s_ptrs, mask=ok, other=0)
        sf = scale_values(s, FMT, DOT_DTYPE)
    else:  # one load per group, broadcast to its G/2 bytes
        GPS: tl.constexpr = BK // G
        offs_g = k0 // G + tl.arange(0, GPS)
        if EVEN:
            s = tl.load(s_rows + offs_g[None, :])
        else:
            s = tl.load(
                s_rows + offs_g[None, :], mask=col_ok[:, None] & (offs_g < k_hi // G)[None, :], other=0
            )
        sg = scale_values(s, FMT, DOT_DTYPE)
        sf = tl.reshape(tl.broadcast_to(sg[:, :, None], (BN, GPS, G // 2)), (BN, HALF))
    lo, hi = _nibbles(packed, FAST, DOT_DTYPE)
    return lo * sf, hi * sf
