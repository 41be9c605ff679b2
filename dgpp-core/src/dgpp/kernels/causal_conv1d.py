"""Depthwise causal conv1d decode step on the pooled conv state (one token per sequence), graph-safe.

Shapes: ``x [B, C]`` (this step's conv inputs), ``weight [C, K]``, ``bias [C]`` or None, ``conv_state
[slots, K-1, C]`` holding each sequence's last ``K-1`` inputs (oldest first), ``state_slots [B]`` (-1 marks
a CUDA-graph padding row: nothing read, nothing written, output zeros), ``fresh [B]`` bool or int8 (the sequence
starts here: its history is zeros whatever the slot holds). Output ``[B, C]`` in x's dtype: the fp32 sum
rounded to x's dtype once, then SiLU when asked (the reference's rounding points). The state shifts by one
input in place.

Everything is read from device tensors, so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton


def conv_decode_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """Row by row (the definition); padding rows are skipped (this syncs with the host)."""
    out = torch.zeros_like(x)
    for b, slot in enumerate(state_slots.tolist()):
        if slot < 0:
            continue
        history = torch.zeros_like(conv_state[slot]) if bool(fresh[b]) else conv_state[slot]
        window = torch.cat([history.to(x.dtype), x[b : b + 1]], dim=0).float()  # [K, C]
        y = (window * weight.float().T).sum(0)
        if bias is not None:
            y = y + bias.float()
        y = y.to(x.dtype)
        out[b] = F.silu(y) if silu else y
        conv_state[slot] = window[1:].to(conv_state.dtype)
    return out


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    slots_ptr,
    fresh_ptr,
    out_ptr,
    channels,
    x_row,
    out_row,
    state_slot_stride,
    state_row,
    KERNEL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < channels
    slot = tl.load(slots_ptr + b).to(tl.int64)
    valid = slot >= 0
    keep_history = valid & (tl.load(fresh_ptr + b) == 0)
    row = state_ptr + tl.maximum(slot, 0) * state_slot_stride + cols
    x = tl.load(x_ptr + b * x_row + cols, mask=cmask, other=0.0)
    # taps 0..K-2 read the history, tap K-1 the new input
    acc = x.to(tl.float32) * tl.load(w_ptr + cols * KERNEL + (KERNEL - 1), mask=cmask, other=0.0).to(
        tl.float32
    )
    for tap in tl.static_range(KERNEL - 1):
        h = tl.load(row + tap * state_row, mask=cmask & keep_history, other=0.0)
        acc += h.to(tl.float32) * tl.load(w_ptr + cols * KERNEL + tap, mask=cmask, other=0.0).to(tl.float32)
        # shift: history row tap-1 takes row tap (row K-2 takes the new input below)
        if tap > 0:
            tl.store(row + (tap - 1) * state_row, h.to(state_ptr.dtype.element_ty), mask=cmask & valid)
    tl.store(row + (KERNEL - 2) * state_row, x.to(state_ptr.dtype.element_ty), mask=cmask & valid)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # round once, like the reference
    if SILU:
        y = y * tl.sigmoid(y)
    y = tl.where(valid, y, 0.0)
    tl.store(out_ptr + b * out_row + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


def conv_decode_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    batch, channels = x.shape
    kernel = weight.shape[-1]
    if kernel < 2 or conv_state.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("conv decode kernel needs kernel >= 2 and contiguous channels")
    weight = weight.contiguous()
    out = torch.empty(
        batch, channels, dtype=x.dtype, device=x.device
    )  # x may be a strided view of wider rows
    block = min(next_pow2(channels), 1024)
    grid = (batch, triton.cdiv(channels, block))
    _conv_decode_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        conv_state,
        state_slots,
        fresh if fresh.dtype == torch.int8 else fresh.to(torch.int8),
        out,
        channels,
        x.stride(0),
        out.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        KERNEL=kernel,
        BLOCK_C=block,
        HAS_BIAS=bias is not None,
        SILU=silu,
    )
    return out


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    fresh: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """Dispatch: Triton on CUDA, the torch reference elsewhere."""
    if use_triton(x):
        return conv_decode_triton(x, weight, bias, conv_state, state_slots, fresh, silu)
    return conv_decode_ref(x, weight, bias, conv_state, state_slots, fresh, silu)
