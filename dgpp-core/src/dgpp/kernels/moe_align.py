"""``align_to_experts`` for decode-sized routing in one Triton program (same outputs, bit for bit).

The torch version in ``dgpp.kernels.moe`` is about fifteen small kernels (sort, scatter, two cumsums,
searchsorted, ...); at decode that launch chain costs more than reading the routed experts' weights.
Here one program sorts the ``n`` assignment keys ``expert * N_PAD + index`` (a stable sort by expert),
finds each expert's run in the sorted order, pads runs to whole ``BM`` blocks with a prefix sum, and
writes ``sorted_ids`` and ``block_expert`` directly. Everything stays on the device.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2, tl, triton

MAX_ASSIGNMENTS = 1024  # one program holds every assignment; larger batches use the torch version
MAX_EXPERTS = 1024


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _align_kernel(
    ids_ptr,
    scratch_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    n,
    capacity,
    num_blocks,
    BM: tl.constexpr,
    N_PAD: tl.constexpr,
    FILL: tl.constexpr,
):
    pos = tl.arange(0, N_PAD)
    valid = pos < n
    expert = tl.load(ids_ptr + pos, mask=valid, other=0).to(tl.int32)
    # invalid lanes sort after every real key; a real key orders by expert, then by assignment index
    keys = tl.where(valid, expert * N_PAD + pos, 2**30 + pos)
    keys = tl.sort(keys)
    s_expert = tl.where(valid, keys // N_PAD, -1)
    s_index = keys % N_PAD
    # neighbours in sorted order go through memory: the sorted experts, then a CTA barrier
    tl.store(scratch_ptr + pos, s_expert)
    offs = tl.arange(0, FILL)
    for c0 in range(0, capacity, FILL):  # every slot starts as padding
        tl.store(sorted_ids_ptr + c0 + offs, n, mask=c0 + offs < capacity)
    for b0 in range(0, num_blocks, FILL):
        tl.store(block_expert_ptr + b0 + offs, -1, mask=b0 + offs < num_blocks)
    tl.debug_barrier()
    prev = tl.load(scratch_ptr + pos - 1, mask=valid & (pos > 0), other=-1)
    nxt = tl.load(scratch_ptr + pos + 1, mask=valid & (pos + 1 < n), other=-1)
    run_start = tl.associative_scan(tl.where(valid & (s_expert != prev), pos, 0), 0, _max_combine)
    rank = pos - run_start
    is_end = valid & (s_expert != nxt)
    padded = tl.where(
        is_end, (rank + BM) // BM * BM, 0
    )  # a run's length rounded up to whole blocks, at its end
    # the runs that ended before p are exactly the runs before p's run: their padded lengths give its start
    run_pad_start = tl.cumsum(padded, 0) - padded
    tl.store(sorted_ids_ptr + run_pad_start + rank, s_index, mask=valid)
    run_blocks = padded // BM
    first_block = run_pad_start // BM
    for j in range(0, tl.max(run_blocks, 0)):
        tl.store(block_expert_ptr + first_block + j, s_expert, mask=j < run_blocks)


def fits(topk_ids: torch.Tensor, num_experts: int) -> bool:
    """Whether one program can align this routing."""
    return topk_ids.numel() <= MAX_ASSIGNMENTS and num_experts <= MAX_EXPERTS


def align_to_experts_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dgpp.kernels.moe.align_to_experts`` in one launch, for ``fits`` routings: the same capacity,
    ``sorted_ids`` and ``block_expert``."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    capacity = triton.cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device)
    n_pad = max(16, next_pow2(n))
    scratch = torch.empty(n_pad, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](
        flat,
        scratch,
        sorted_ids,
        block_expert,
        n,
        capacity,
        capacity // block_m,
        BM=block_m,
        N_PAD=n_pad,
        FILL=1024,
        num_warps=4,
    )
    return sorted_ids, block_expert
