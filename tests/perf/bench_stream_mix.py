"""The gated stream mix (``dgpp.kernels.hyper_streams.stream_mix``) at Qwen3.8-Flash-Next's shape, one decode row:
time per call for each up-tile size and warp count, and the largest difference from the torch reference. Weight sets
are rotated so each call reads its up matrix from HBM. Not a CI test.

    python3 tests/perf/bench_stream_mix.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "dgpp-core" / "src")]

import torch  # noqa: E402
import triton.testing  # noqa: E402

import dgpp.kernels.hyper_streams as hyper_streams  # noqa: E402

TOKENS, STREAMS, HIDDEN, RANK = 1, 4, 2560, 320
WEIGHT_SETS = 16  # 16 x 6.5 MB: past the L2


def main() -> None:
    normed = torch.randn(TOKENS, STREAMS * HIDDEN, device="cuda", dtype=torch.bfloat16)
    low = torch.randn(TOKENS, RANK, device="cuda", dtype=torch.bfloat16)
    ups = [
        torch.randn(STREAMS * HIDDEN, RANK, device="cuda", dtype=torch.bfloat16) * RANK**-0.5
        for _ in range(WEIGHT_SETS)
    ]
    step = hyper_streams.StreamMixInputs(normed, low, ups[0], STREAMS)
    ref = hyper_streams.stream_mix_ref(step).float()
    turn = [0]

    def call() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % WEIGHT_SETS
        return hyper_streams.stream_mix_triton(step._replace(up_weight=ups[turn[0]]))

    for tile in (8192, 4096, 2048, 1024):
        for warps in (1, 2, 4, 8):
            hyper_streams._MIX_TILE, hyper_streams._MIX_WARPS = tile, warps
            err = float((hyper_streams.stream_mix_triton(step).float() - ref).abs().max())
            us = triton.testing.do_bench(call, warmup=20, rep=200) * 1e3
            gbs = STREAMS * HIDDEN * RANK * 2 / us / 1e3
            print(
                f"up tile {tile} warps {warps}: {us:.1f} us, {gbs:.0f} GB/s, max |diff| vs reference {err:.2e}"
            )


if __name__ == "__main__":
    main()
