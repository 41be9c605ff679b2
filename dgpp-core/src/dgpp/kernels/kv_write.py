"""Store this step's K/V rows into the paged pool at ``slot_mapping`` (flat ``block * block_size + offset``).

A slot of -1 writes nothing (CUDA-graph padding rows, rows whose K/V is not kept). The torch path
in ``dgpp.nn.attention.write_kv`` selects the kept rows with a boolean mask, which needs the host;
this kernel masks per row on the device, so a captured decode step can include it.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton


def write_kv_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    if v_cache.numel():  # a K-only entry (DSA index keys) pairs its keys with an empty V
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


@triton.jit
def _write_rows(
    src,
    dst,
    row,
    slot,
    heads,
    dim,
    s_tok,
    s_head,
    d_slot,
    d_head,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < dim) & (slot >= 0)
    x = tl.load(src + row * s_tok + h * s_head + d, mask=mask)
    tl.store(dst + slot * d_slot + h * d_head + d, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    heads,
    k_dim,
    v_dim,
    k_tok,
    k_head,
    v_tok,
    v_head,
    kc_slot,
    kc_head,
    vc_slot,
    vc_head,
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    _write_rows(k_ptr, kc_ptr, row, slot, heads, k_dim, k_tok, k_head, kc_slot, kc_head, BLOCK_H, BLOCK_DK)
    _write_rows(v_ptr, vc_ptr, row, slot, heads, v_dim, v_tok, v_head, vc_slot, vc_head, BLOCK_H, BLOCK_DV)


def write_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    tokens, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if tokens:
        # a flat slot addresses [block, offset] because a block's token rows are contiguous
        _write_kv_kernel[(tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            heads,
            k_dim,
            v_dim,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(1),
            v_cache.stride(2),
            BLOCK_H=next_pow2(heads),
            BLOCK_DK=next_pow2(k_dim),
            BLOCK_DV=next_pow2(v_dim),
            num_warps=4,
        )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter K/V rows into the pool (in place); Triton on CUDA, torch elsewhere."""
    fn = write_kv_triton if use_triton(k) else write_kv_ref
    fn(k_cache, v_cache, k, v, slot_mapping)
