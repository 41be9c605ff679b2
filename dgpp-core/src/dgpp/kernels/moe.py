"""Fused top-k MoE: grouped GEMMs over the routed experts, SwiGLU fused into the first one.

``fused_moe(x [T, H], gate_up [E, 2I, H], down [E, H, I], topk_weights [T, K], topk_ids [T, K]) -> [T, H]``
computes ``sum_k w[t, k] * down_e(silu(gate_e x_t) * up_e x_t)`` with ``e = topk_ids[t, k]`` (the
transformers 5 fused layout: gate rows first, then up rows). ``swiglu_limit`` clamps the SwiGLU inputs
first (gate from above, up on both sides: DeepSeek-V4's experts).

The ``T*K`` (token, expert) assignments are sorted by expert on the device and laid out in blocks of
``BM`` rows, each block holding one expert's rows (padded with a sentinel), so one GEMM launch
serves every expert and each expert's weights are read once per block of its rows. No step needs
the host: block counts use the worst case, and blocks past the used ones do no work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels import moe_align
from dgpp.kernels._triton import next_pow2, tl, triton, use_triton
from dgpp.policy import current


def fused_moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token].float(), gate_up[expert].float()).chunk(2, dim=-1)
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
        act = (F.silu(gate) * up).to(x.dtype).float()  # the activation is stored in the model dtype
        y = F.linear(act, down[expert].float()) * topk_weights[token, slot, None].float()
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def align_to_experts(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments sorted by expert in ``block_m``-row blocks, without a host sync.

    Returns ``sorted_ids [capacity]`` (assignment index ``t*K + k``, or ``T*K`` for padding) and
    ``block_expert [capacity / block_m]`` (the expert of each block, -1 past the used blocks).
    """
    flat = topk_ids.flatten().long()
    n = flat.numel()
    # worst case: each used expert wastes block_m - 1 rows, and at most min(n, E) experts are used
    capacity = triton.cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    # per-expert counts by a scatter into a fixed-size tensor: torch.bincount sizes its output from the
    # data (a host sync), which would break CUDA-graph capture of a MoE decode step
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_sorted]
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[(pad_end - padded)[expert_sorted] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    topk_w_ptr,
    num_assign,
    top_k,
    n_out,
    k_dim,
    a_row_stride,
    b_e,
    b_n,
    b_k,
    c_row_stride,
    GATHER_TOKENS: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCATTER_WEIGHTED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr = 0.0,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    k_end = tl.where(expert >= 0, k_dim, 0)  # unused blocks run no iterations
    expert = tl.maximum(expert, 0)
    rows = pid_m * BM + tl.arange(0, BM)
    sid = tl.load(sorted_ids_ptr + rows)
    rvalid = sid < num_assign
    if GATHER_TOKENS:  # first GEMM reads token rows; the second reads its own sorted rows
        a_rows = (sid // top_k).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < n_out
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    b_base = b_ptr + expert * b_e
    for k0 in range(0, k_end, BK):
        kk = k0 + ks
        kmask = kk < k_dim
        a = tl.load(
            a_ptr + a_rows[:, None] * a_row_stride + kk[None, :],
            mask=rvalid[:, None] & kmask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + cols[None, :] * b_n + kk[:, None] * b_k, mask=kmask[:, None] & cmask[None, :], other=0.0
        )
        acc += tl.dot(a, b, input_precision=PRECISION)
        if SWIGLU:
            b_up = tl.load(
                b_base + (cols[None, :] + n_out) * b_n + kk[:, None] * b_k,
                mask=kmask[:, None] & cmask[None, :],
                other=0.0,
            )
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)
    if SWIGLU:
        if SWIGLU_LIMIT > 0:  # clamped SwiGLU: gate <= limit, -limit <= up <= limit
            acc = tl.minimum(acc, SWIGLU_LIMIT)
            acc_up = tl.minimum(tl.maximum(acc_up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    c_rows = rows.to(tl.int64)
    if SCATTER_WEIGHTED:
        acc = acc * tl.load(topk_w_ptr + sid, mask=rvalid, other=0.0).to(tl.float32)[:, None]
        c_rows = sid.to(tl.int64)
    tl.store(
        c_ptr + c_rows[:, None] * c_row_stride + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=rvalid[:, None] & cmask[None, :],
    )


# (BN, BK, num_warps, num_stages) of both grouped GEMMs; ``tile=`` overrides it (GPU sweeps). H200, the
# Qwen3.5-122B-A10B experts (3072 -> 2x1024, top 8 of 256), graph replays with rotated routing: one token
# 96.8 us with (32, 128, 4, 3) against 121.6 us with the former (64, 64, 4, 2); 8 and 64 tokens 357 and
# 1112 us with (64, 64, 4, 3) (371 and 1188 before). Neither BN nor BK changes a row's bits (one MMA
# accumulator fed in K order).
DECODE_TILE = (32, 128, 4, 3)
DEFAULT_TILE = (64, 64, 4, 3)
DECODE_ASSIGNMENTS = 16  # token x top-k assignments up to which DECODE_TILE is used
# prompts: 128-wide output tiles read each row block's activations half as often (H100, 8,192 tokens: MiMo-V2.6's
# experts at TP 4 3,870 us against 4,578, Qwen3.5-122B's at TP 8 1,372 against 1,443; the same bits)
PREFILL_TILE = (128, 64, 4, 3)
PREFILL_ASSIGNMENTS = 4096  # from this many assignments on, PREFILL_TILE


def launch_tile(n_assign: int) -> tuple[int, int, int, int]:
    """Both grouped GEMMs' tile for ``n_assign`` token x top-k assignments: decode, default or prompt."""
    if n_assign <= DECODE_ASSIGNMENTS:
        return DECODE_TILE
    return PREFILL_TILE if n_assign >= PREFILL_ASSIGNMENTS else DEFAULT_TILE


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tile: tuple[int, int, int, int] | None = None,
    swiglu_limit: float | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    n_assign = tokens * top_k
    # one row block for every token count when rows must not depend on the step (dgpp.nn.exact.routing):
    # a tile's rows are independent of each other only for a fixed BM (the dot instruction follows BM)
    block_m = 64 if current().exact_routing or n_assign > 4 * num_experts else 16
    # decode-sized routings sort in one launch (the same outputs as the torch chain's ~25 small kernels)
    align = moe_align.align_to_experts_triton if moe_align.fits(topk_ids, num_experts) else align_to_experts
    sorted_ids, block_expert = align(topk_ids, num_experts, block_m)
    capacity = sorted_ids.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(capacity, inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.contiguous().view(-1)
    bn, bk, warps, stages = tile or launch_tile(n_assign)
    _grouped_gemm_kernel[(capacity // block_m, triton.cdiv(inter, bn))](
        x,
        gate_up,
        act,
        sorted_ids,
        block_expert,
        weights,
        n_assign,
        top_k,
        inter,
        hidden,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up.stride(2),
        act.stride(0),
        GATHER_TOKENS=True,
        SWIGLU=True,
        SCATTER_WEIGHTED=False,
        BM=block_m,
        BN=bn,
        BK=bk,
        PRECISION=precision,
        SWIGLU_LIMIT=swiglu_limit_constant(swiglu_limit),
        num_warps=warps,
        num_stages=stages,
    )
    per_assign = torch.empty(n_assign, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm_kernel[(capacity // block_m, triton.cdiv(hidden, bn))](
        act,
        down,
        per_assign,
        sorted_ids,
        block_expert,
        weights,
        n_assign,
        top_k,
        hidden,
        inter,
        act.stride(0),
        down.stride(0),
        down.stride(1),
        down.stride(2),
        per_assign.stride(0),
        GATHER_TOKENS=False,
        SWIGLU=False,
        SCATTER_WEIGHTED=True,
        BM=block_m,
        BN=bn,
        BK=bk,
        PRECISION=precision,
        num_warps=warps,
        num_stages=stages,
    )
    return sum_experts(per_assign.view(tokens, top_k, hidden), x.dtype, add)


def sum_experts_ref(
    per_token: torch.Tensor, dtype: torch.dtype, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``per_token [T, K, H]`` fp32 summed over K by explicit adds in k order, then cast to ``dtype``; plus
    ``add [T, H]`` (``dtype``: a shared expert's output) after that cast, when given."""
    total = per_token[:, 0].clone()
    for k in range(1, per_token.shape[1]):
        total += per_token[:, k]
    return total.to(dtype) if add is None else total.to(dtype) + add


@triton.jit
def _sum_experts_kernel(
    src_ptr, add_ptr, out_ptr, top_k, hidden, s_tok, s_k, a_tok, o_tok, ADD: tl.constexpr, BLOCK: tl.constexpr
):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    total = tl.load(src_ptr + tok * s_tok + cols, mask=mask, other=0.0)
    for k in range(1, top_k):  # fp32 adds in k order: the bits of the explicit chain
        total += tl.load(src_ptr + tok * s_tok + k * s_k + cols, mask=mask, other=0.0)
    out = total.to(out_ptr.dtype.element_ty)
    if ADD:  # the chain's `out + shared`: the rounded sum plus the addend, rounded again
        out = (out.to(tl.float32) + tl.load(add_ptr + tok * a_tok + cols, mask=mask).to(tl.float32)).to(
            out_ptr.dtype.element_ty
        )
    tl.store(out_ptr + tok * o_tok + cols, out, mask=mask)


def sum_experts(per_token: torch.Tensor, dtype: torch.dtype, add: torch.Tensor | None = None) -> torch.Tensor:
    """Fixed-order sum over each token's experts (deterministic, no atomics; a reduction kernel's split of the
    k axis could follow the token count), plus ``add`` (a shared expert's output) when given: one launch on
    CUDA, the same bits as ``sum_experts_ref``."""
    if not use_triton(per_token) or per_token.stride(-1) != 1 or (add is not None and add.stride(-1) != 1):
        return sum_experts_ref(per_token, dtype, add)
    tokens, top_k, hidden = per_token.shape
    out = torch.empty(tokens, hidden, dtype=dtype, device=per_token.device)
    block = min(1024, next_pow2(hidden))
    if tokens:
        _sum_experts_kernel[(tokens, triton.cdiv(hidden, block))](
            per_token,
            add if add is not None else out,
            out,
            top_k,
            hidden,
            per_token.stride(0),
            per_token.stride(1),
            add.stride(0) if add is not None else 0,
            out.stride(0),
            ADD=add is not None,
            BLOCK=block,
        )
    return out


def swiglu_limit_constant(swiglu_limit: float | None) -> float:
    """The kernels' ``SWIGLU_LIMIT`` constant: 0 means no clamp."""
    if swiglu_limit is not None and swiglu_limit <= 0:
        raise ValueError(f"swiglu_limit must be > 0, got {swiglu_limit}")
    return float(swiglu_limit or 0.0)


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts for each token, weighted and summed, plus ``add`` (``x``'s dtype, e.g. the shared
    expert's output) when given; Triton on CUDA (the add in the sum's launch), torch elsewhere."""
    if use_triton(x):
        return fused_moe_triton(x, gate_up, down, topk_weights, topk_ids, swiglu_limit=swiglu_limit, add=add)
    out = fused_moe_ref(x, gate_up, down, topk_weights, topk_ids, swiglu_limit)
    return out if add is None else out + add
