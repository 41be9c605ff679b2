"""The fused MoE kernel at Qwen3-30B-A3B sizes on the GPU, and a tile sweep at Qwen3.5-122B-A10B expert sizes from
CUDA-graph replays."""

# ruff: noqa: B023  (each timing lambda runs before its loop variables move on)

from __future__ import annotations

import torch
import triton.testing
from kernel_checks_record import BF16, DEV, record, rel_err

from dgpp.kernels import moe


def check_moe() -> None:
    experts, top_k, hidden, inter = 128, 8, 2048, 768  # Qwen3-30B-A3B geometry
    gate_up = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device=DEV, dtype=BF16) * inter**-0.5
    for tokens in (1, 64, 2048):
        x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
        w, ids = torch.randn(tokens, experts, device=DEV).softmax(-1).topk(top_k, -1)
        out = moe.fused_moe_triton(x, gate_up, down, w, ids)
        ref = moe.fused_moe_ref(x.float(), gate_up.float(), down.float(), w, ids)
        used = int(torch.unique(ids).numel())
        record(
            f"fused moe T={tokens} E=128 k=8 2048/768",
            rel_err(out, ref),
            2e-2,
            lambda: moe.fused_moe_triton(x, gate_up, down, w, ids),
            lambda: moe.fused_moe_ref(x, gate_up, down, w, ids),
            used * 3 * inter * hidden * 2,
        )
    # Qwen3.5-122B-A10B experts (hidden 3072, 1024, 256 experts, top 8): tile sweep from graph replays, the
    # routing rotated over 8 sets so the experts' weights come from HBM
    experts, top_k, hidden, inter = 256, 8, 3072, 1024
    gate_up = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device=DEV, dtype=BF16) * inter**-0.5
    for tokens in (1, 8, 64):
        x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
        routes = [torch.randn(tokens, experts, device=DEV).softmax(-1).topk(top_k, -1) for _ in range(8)]
        ref = moe.fused_moe_ref(x.float(), gate_up.float(), down.float(), *routes[0])
        used = sum(int(torch.unique(ids).numel()) for _, ids in routes) / len(routes)
        for tile in (None, (32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3)):
            try:
                err = rel_err(moe.fused_moe_triton(x, gate_up, down, *routes[0], tile=tile), ref)
                graph = torch.cuda.CUDAGraph()
                moe.fused_moe_triton(x, gate_up, down, *routes[0], tile=tile)
                with torch.cuda.graph(graph):
                    for w, ids in routes:
                        moe.fused_moe_triton(x, gate_up, down, w, ids, tile=tile)
                ms = triton.testing.do_bench(graph.replay, warmup=5, rep=30, return_mode="median") / len(
                    routes
                )
                print(
                    f"moe sweep 122B experts T={tokens} tile {tile or 'default'}: {ms * 1e3:.1f} us, "
                    f"{used * 3 * inter * hidden * 2 / ms / 1e6:.0f} GB/s of routed experts, err {err:.1e}",
                    flush=True,
                )
            except Exception as e:  # a tile that does not fit
                print(f"moe sweep tile {tile}: {type(e).__name__}: {e}", flush=True)
