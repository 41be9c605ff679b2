"""The gated stream mix (``dgpp.kernels.hyper_streams.stream_mix``) at Qwen3.8-Flash-Next's shape: time per call
at 1, 64 and 8,192 tokens for each column-tile width and warp count, the largest difference from the torch
reference, and whether a token alone gets the bits it gets among all. Weight sets are rotated so each call reads
its up matrix from HBM. Not a CI test.

    python3 tests/perf/bench_stream_mix.py [--tokens 1,64,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "dgpp-core" / "src")]

import torch  # noqa: E402
import triton.testing  # noqa: E402

import dgpp.kernels.hyper_streams as hyper_streams  # noqa: E402

STREAMS, HIDDEN, RANK = 4, 2560, 320
WEIGHT_SETS = 16  # 16 x 6.5 MB: past the L2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64,8192")
    args = parser.parse_args()
    ups = [
        torch.randn(STREAMS * HIDDEN, RANK, device="cuda", dtype=torch.bfloat16) * RANK**-0.5
        for _ in range(WEIGHT_SETS)
    ]
    print("| tokens | columns | warps | us | max diff vs reference | alone == among all |")
    print("|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        normed = torch.randn(tokens, STREAMS * HIDDEN, device="cuda", dtype=torch.bfloat16)
        low = torch.randn(tokens, RANK, device="cuda", dtype=torch.bfloat16)
        step = hyper_streams.StreamMixInputs(normed, low, ups[0], STREAMS)
        ref = hyper_streams.stream_mix_ref(step).float()
        turn = [0]

        def call(step=step, turn=turn) -> torch.Tensor:
            turn[0] = (turn[0] + 1) % WEIGHT_SETS
            return hyper_streams.stream_mix_triton(step._replace(up_weight=ups[turn[0]]))

        for columns in (16, 32):
            for warps in (2, 4, 8):
                hyper_streams._MIX_COLUMNS, hyper_streams._MIX_WARPS = columns, warps
                out = hyper_streams.stream_mix_triton(step)
                err = float((out.float() - ref).abs().max())
                last = tokens - 1
                alone = hyper_streams.stream_mix_triton(step._replace(normed=normed[last:], low=low[last:]))
                same = bool(torch.equal(alone[0], out[last]))
                us = triton.testing.do_bench(call, warmup=10, rep=100) * 1e3
                print(f"| {tokens} | {columns} | {warps} | {us:.1f} | {err:.2e} | {same} |")


if __name__ == "__main__":
    main()
