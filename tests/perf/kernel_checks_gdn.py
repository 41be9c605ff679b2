"""Gated delta-rule kernels at Qwen3-Next / Qwen3.5 sizes on the GPU: the decode step and the chunked prefill."""

# ruff: noqa: B023  (each timing lambda runs before its loop variables move on)

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_checks_record import BF16, DEV, record, rel_err

from dgpp.kernels import gated_delta as gd


def check_gated_delta() -> None:
    from dgpp.nn.gated_deltanet import chunked_gated_delta_rule, gated_delta_step

    hk, hv, dk, dv = 16, 32, 128, 128  # Qwen3-Next / Qwen3.5 linear-attention geometry
    for batch in (1, 64):
        q, k = (
            torch.randn(batch, hk, dk, device=DEV, dtype=BF16),
            torch.randn(batch, hk, dk, device=DEV, dtype=BF16),
        )
        v = torch.randn(batch, hv, dv, device=DEV, dtype=BF16)
        g = -F.softplus(torch.randn(batch, hv, device=DEV))
        beta = torch.rand(batch, hv, device=DEV, dtype=BF16)
        pool = torch.randn(batch + 1, hv, dk, dv, device=DEV) * 0.1
        slots, fresh = torch.arange(batch, device=DEV), torch.zeros(batch, dtype=torch.bool, device=DEV)
        starts = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        ref_pool = pool.clone()
        ref = gd.gated_delta_ref(q, k, v, g, beta, ref_pool, slots, starts, fresh)
        work = pool.clone()
        out = gd.gdn_decode_step_triton(q, k, v, g, beta, work, slots, fresh)
        record(
            f"gdn decode step B={batch} 16/32x128",
            max(rel_err(out, ref), rel_err(work, ref_pool)),
            1e-4,
            lambda: gd.gdn_decode_step_triton(q, k, v, g, beta, work, slots, fresh),
            lambda: gated_delta_step(q, k, v, g, beta, pool[:batch]),
            2 * pool[:batch].numel() * 4,
        )
    for length in (512, 8192):
        q, k = (
            torch.randn(length, hk, dk, device=DEV, dtype=BF16),
            torch.randn(length, hk, dk, device=DEV, dtype=BF16),
        )
        v = torch.randn(length, hv, dv, device=DEV, dtype=BF16)
        g = -F.softplus(torch.randn(length, hv, device=DEV)) * 0.2
        beta = torch.rand(length, hv, device=DEV, dtype=BF16)
        state = torch.randn(1, hv, dk, dv, device=DEV) * 0.1
        ref, ref_state = chunked_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state)
        pool = state.clone()
        one = (
            torch.zeros(1, dtype=torch.long, device=DEV),
            torch.tensor([0, length], device=DEV, dtype=torch.int32),
            torch.zeros(1, dtype=torch.bool, device=DEV),
        )
        out = gd.gdn_chunked_prefill_triton(q, k, v, g, beta, pool, *one)
        err = max(rel_err(out, ref[0]), rel_err(pool[0], ref_state[0]))
        record(
            f"gdn chunked prefill L={length} 16/32x128",
            err,
            1e-3,
            lambda: gd.gdn_chunked_prefill_triton(q, k, v, g, beta, state.clone(), *one),
            lambda: chunked_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state),
            length * (2 * hk * dk + hv * dv) * 2,
        )
