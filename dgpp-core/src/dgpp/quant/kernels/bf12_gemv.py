"""Triton GEMV over the bf12 form: rebuilds each weight's bf16 bits from its sign+mantissa
byte and 4-bit exponent code in registers, so a step reads 0.75 of the bf16 bytes.

The kernel treats escape codes (15) as zero; the caller adds the escaped weights from the per-row side
table and overwrites raw rows, both small. Bits are widened straight to fp32 (bf16 bits << 16), which is
exact and keeps bf16 arithmetic out of the kernel (the interpreter's bf16 is broken).
Status: checked against the torch decode under TRITON_INTERPRET=1 only; on GPU it is opt-in
(``DGPP_BF12_TRITON=1``) until it has been measured there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dgpp.quant.bf12 import SUPER_BLOCK, SUPER_BYTES
from dgpp.quant.format import cdiv


@triton.jit
def _weights(sm, code, base):
    bits = ((sm & 0x80) << 8) | (((code + base[:, None]) & 0xFF) << 7) | (sm & 0x7F)
    bits = tl.where(code == 15, 0, bits)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def bf12_gemv_kernel(
    x_ptr,
    packed_ptr,
    base_ptr,
    out_ptr,
    N,
    SB,
    stride_xm,
    stride_pn,
    stride_om,
    stride_os,
    sb_per_split,
    BN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    base = tl.load(base_ptr + offs_n, mask=n_ok, other=0).to(tl.int32)
    p = tl.arange(0, 512)
    col_a = 32 * (p // 16) + p % 16  # sm A position p -> column in the super-block; sm B is 16 further
    acc = tl.zeros((BN, 512), dtype=tl.float32)
    sb_lo = pid_s * sb_per_split
    sb_hi = tl.minimum(sb_lo + sb_per_split, SB)
    for sb in range(sb_lo, sb_hi):
        row = packed_ptr + offs_n[:, None] * stride_pn + sb * 1536 + p[None, :]
        sm_a = tl.load(row, mask=n_ok[:, None], other=0).to(tl.int32)
        sm_b = tl.load(row + 512, mask=n_ok[:, None], other=0).to(tl.int32)
        e = tl.load(row + 1024, mask=n_ok[:, None], other=0).to(tl.int32)
        x_row = x_ptr + pid_m * stride_xm + sb * 1024 + col_a
        x_a = tl.load(x_row).to(tl.float32)
        x_b = tl.load(x_row + 16).to(tl.float32)
        acc += _weights(sm_a, e & 15, base) * x_a[None, :] + _weights(sm_b, e >> 4, base) * x_b[None, :]
    tl.store(out_ptr + pid_s * stride_os + pid_m * stride_om + offs_n, tl.sum(acc, axis=1), mask=n_ok)


def bf12_matmul(
    tensors: dict[str, torch.Tensor], x: torch.Tensor, shape: tuple[int, int], bn: int = 16, split_k: int = 1
) -> torch.Tensor:
    """``x [.., K] @ W^T`` for a bf12-packed W (kernel + escape/raw-row fix-ups)."""
    n, k = shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    sb = k // SUPER_BLOCK
    per_split = cdiv(sb, split_k)
    split = cdiv(sb, per_split)
    packed = tensors["packed"].reshape(n, sb * SUPER_BYTES)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    bf12_gemv_kernel[(m, cdiv(n, bn), split)](
        x2,
        packed,
        tensors["base"],
        partial,
        n,
        sb,
        x2.stride(0),
        packed.stride(0),
        partial.stride(1),
        partial.stride(0),
        per_split,
        BN=bn,
    )
    y = partial[0] if split == 1 else partial.sum(0)
    entries = tensors["escapes"].to(torch.int64) & 0xFFFFFFFF
    if entries.numel():
        offsets = tensors["escape_offsets"].long()
        rows = torch.repeat_interleave(torch.arange(n, device=x.device), offsets[1:] - offsets[:-1])
        values = ((entries & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
        y = y.index_add(1, rows, x2[:, entries >> 16].float() * values)
    raw_rows = tensors["raw_rows"].long()
    if raw_rows.numel():
        y[:, raw_rows] = x2.float() @ tensors["raw"].float().t()
    return y.to(x.dtype).reshape(*lead, n)
