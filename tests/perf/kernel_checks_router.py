"""The one-launch MoE router (``dgpp.kernels.router_topk``) against the torch chain it replaces, timed eagerly and
as a replayed CUDA graph (a decode step's router runs inside one)."""

# ruff: noqa: B023  (each timing lambda runs before its loop variables move on)

from __future__ import annotations

import math

import torch
from kernel_checks_record import BF16, DEV, record, rel_err

from dgpp.kernels.router_topk import RouterTopKInputs, router_topk_ref, router_topk_triton


def _captured(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile / warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def check_router() -> None:
    """The same experts in the same order as ``router_topk_ref``, fp32 weights within fp32 rounding."""
    # (experts, n_group, topk_group, top_k, scoring): DeepSeek-V3-style groups, GLM-5.3, DeepSeek-V4.1,
    # Qwen3-30B-A3B; a correction bias except for softmax
    shapes = [
        (256, 8, 4, 8, "sigmoid"),
        (256, 1, 1, 8, "sigmoid"),
        (256, 1, 1, 6, "sqrtsoftplus"),
        (128, 1, 1, 8, "softmax"),
    ]
    for experts, n_group, topk_group, top_k, scoring in shapes:
        name = f"{scoring} E={experts} groups {topk_group}/{n_group} k={top_k}"
        bias = None if scoring == "softmax" else torch.randn(experts, device=DEV) * 0.1 - 0.05
        for tokens in (1, 64, 2048):
            logits = torch.randn(tokens, experts, device=DEV)
            exact = RouterTopKInputs(
                logits, bias, top_k, scoring, True, 2.5, torch.float32, n_group, topk_group
            )
            w, ids = router_topk_triton(exact)
            ref_w, ref_ids = router_topk_ref(exact)
            err = rel_err(w, ref_w) if torch.equal(ids, ref_ids) else math.inf
            step = exact._replace(out_dtype=BF16)  # as served: bf16 weights
            fast, slow = lambda: router_topk_triton(step), lambda: router_topk_ref(step)
            record(f"router {name} T={tokens}", err, 1e-5, fast, slow, logits.numel() * 4)
            graphs = _captured(fast), _captured(slow)
            record(
                f"router {name} T={tokens} graph",
                err,
                1e-5,
                graphs[0].replay,
                graphs[1].replay,
                logits.numel() * 4,
            )
