"""A decode step's latent rows written into window rings held as FP8 E4M3 codes with a power-of-two (E8M0) scale per
``block`` values (``dgpp.kernels.block_scaled_tiles`` reads them), quantized in the same launch.

``kv [R, D]`` (one row per sequence, at ``positions[r]``) goes to ``ring[slots[r], positions[r] % cap, 0]``, a
``uint8`` row of ``D`` codes then ``D / block`` scale bytes. A block's scale is ``2^ceil(log2(amax / 448))``, its
``amax`` floored at ``amax_floor``, and its codes ``x / scale`` clamped to +-448 and rounded to nearest E4M3 (ties to
even); values already in this form (the rows a layer rounded to it) come back unchanged. A padding row (slot -1
or ``seq_lens`` 0) writes nothing. One program per row, no host value read: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton
from dgpp.kernels.quantized_write import e4m3_code


@triton.jit
def _ring_write_kernel(
    kv_ptr,
    ring_ptr,
    slot_ptr,
    pos_ptr,
    len_ptr,
    dim,
    cap,
    kv_r,
    ring_s,
    ring_t,
    amax_floor,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + r)
    if (slot >= 0) & (tl.load(len_ptr + r) > 0):
        blocks = tl.arange(0, NUM_BLOCKS)
        cols = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        bmask = blocks * BLOCK < dim
        x = tl.load(kv_ptr + r * kv_r + cols, mask=bmask[:, None], other=0.0).to(tl.float32)
        limit = tl.maximum(tl.max(tl.abs(x), axis=1), amax_floor) * (1.0 / 448.0)
        bits = limit.to(tl.int32, bitcast=True)
        # 2^ceil(log2(limit)) as a biased exponent: one up unless the mantissa is zero
        exponent = ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
        codes = e4m3_code(tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)).to(tl.uint8)
        row = slot.to(tl.int64) * ring_s + (tl.load(pos_ptr + r) % cap).to(tl.int64) * ring_t
        tl.store(ring_ptr + row + cols, codes, mask=bmask[:, None])
        tl.store(ring_ptr + row + dim + blocks, exponent.to(tl.uint8), mask=bmask)


def ring_write_fp8_blocks_triton(
    kv: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block: int = 32,
    amax_floor: float = 1e-4,
) -> None:
    """Quantize and store one decode step's rows ``kv [R, D]`` into ``ring [slots, cap, 1, D + D / block]``."""
    rows, dim = kv.shape
    if ring.dtype != torch.uint8 or ring.shape[-1] != dim + dim // block or dim % block:
        raise ValueError(
            f"a block-scaled FP8 ring holds uint8 rows of {dim + dim // block} bytes for {dim} values "
            f"(blocks of {block}): got {ring.dtype} rows of {ring.shape[-1]}"
        )
    if rows == 0:
        return
    _ring_write_kernel[(rows,)](
        kv,
        ring,
        slots,
        positions,
        seq_lens,
        dim,
        ring.shape[1],
        kv.stride(0),
        ring.stride(0),
        ring.stride(1),
        float(amax_floor),
        BLOCK=block,
        NUM_BLOCKS=next_pow2(dim // block),
        num_warps=4,
    )
