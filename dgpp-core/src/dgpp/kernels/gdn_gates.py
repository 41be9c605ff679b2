"""The gated delta rule's per-head gates from their projections, in one pass.

``a, b [T, H]`` (the ``in_proj_a`` / ``in_proj_b`` outputs), ``A_log, dt_bias [H]`` ->
``g = -exp(A_log) · softplus(a + dt_bias)`` (fp32, the log decay) and ``beta = sigmoid(b)`` (in b's dtype).
Computed in fp32 as the layer's torch chain does (``a`` and ``A_log`` upcast, ``dt_bias`` promoted; beta's
sigmoid rounded to b's dtype); softplus follows torch's threshold (``x`` above 20). One program per token
replaces the chain's eight launches (two casts, exp, negation, add, softplus, product, sigmoid).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels._triton import next_pow2, tl, triton, use_triton


def gdn_gates_ref(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


@triton.jit
def _gdn_gates_kernel(
    a_ptr,
    b_ptr,
    alog_ptr,
    dt_ptr,
    g_ptr,
    beta_ptr,
    heads,
    a_stride,
    b_stride,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK)
    mask = h < heads
    a = tl.load(a_ptr + tok * a_stride + h, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + tok * b_stride + h, mask=mask, other=0.0).to(tl.float32)
    x = a + tl.load(dt_ptr + h, mask=mask, other=0.0).to(tl.float32)
    # softplus: x past torch's threshold; log(1 + e^x) loses e^x in 1 + e^x far below 0, where it equals e^x
    ex = tl.exp(tl.minimum(x, 20.0))
    soft = tl.where(x > 20.0, x, tl.where(x < -15.0, ex, tl.log(1.0 + ex)))
    decay = tl.exp(tl.load(alog_ptr + h, mask=mask, other=0.0).to(tl.float32))
    tl.store(g_ptr + tok * heads + h, -decay * soft, mask=mask)
    beta = 1.0 / (1.0 + tl.exp(-b))
    tl.store(beta_ptr + tok * heads + h, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gates_triton(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if a.dim() != 2 or a.shape != b.shape or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("gdn_gates needs a and b [T, H] of one shape with a contiguous last dim")
    tokens, heads = a.shape
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(tokens, heads, dtype=b.dtype, device=b.device)
    if tokens:
        _gdn_gates_kernel[(tokens,)](
            a,
            b,
            A_log,
            dt_bias,
            g,
            beta,
            heads,
            a.stride(0),
            b.stride(0),
            BLOCK=next_pow2(heads),
            num_warps=1,
        )
    return g, beta


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` of the gated delta rule; one Triton launch on CUDA, torch elsewhere."""
    fn = gdn_gates_triton if use_triton(a) else gdn_gates_ref
    return fn(a, b, A_log, dt_bias)
