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
    # (name, experts, n_group, topk_group, top_k, softmax): DeepSeek-V3-style groups, GLM-5.3, Qwen3-30B-A3B
    shapes = [
        ("grouped sigmoid+bias E=256 8/4 groups k=8", 256, 8, 4, 8, False),
        ("sigmoid+bias E=256 k=8", 256, 1, 1, 8, False),
        ("softmax E=128 k=8", 128, 1, 1, 8, True),
    ]
    for name, experts, n_group, topk_group, top_k, softmax in shapes:
        bias = None if softmax else torch.randn(experts, device=DEV) * 0.1 - 0.05
        for tokens in (1, 64, 2048):
            logits = torch.randn(tokens, experts, device=DEV)
            exact = RouterTopKInputs(
                logits, bias, top_k, softmax, True, 2.5, torch.float32, n_group, topk_group
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
