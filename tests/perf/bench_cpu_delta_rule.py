"""The CPU gated delta rule: the row form (every row one recurrent step, the CPU's canonical path) against the
chunked form it replaced, process CPU time of a prompt and of a decode row (docs/benchmarks.md, "CPU delta-rule
rows").

    python tests/perf/bench_cpu_delta_rule.py [--tokens 512] [--threads 1]

Random fp32 inputs, a decay per head, one sequence from a zero state; geometries: a Qwen3.5 linear-attention layer
(16 value heads of 128 x 128) and a small one (4 heads of 64 x 64).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from dgpp.nn.gated_delta_rule import gated_delta_rule_rows, gated_delta_rule_varlen

GEOMETRIES = ((16, 128), (4, 64))


def cpu_ms(fn: Callable[..., object], args: tuple, repeats: int) -> float:
    fn(*args)
    start = time.process_time()
    for _ in range(repeats):
        fn(*args)
    return (time.process_time() - start) / repeats * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), a {args.tokens}-token prompt")
    print(
        "| heads x dk x dv | prompt, row form ms | prompt, chunked ms | decode row, row form us | decode row, recurrent step us |"
    )
    print("|---|---|---|---|---|")
    for heads, dim in GEOMETRIES:
        gen = torch.Generator().manual_seed(0)
        n = args.tokens
        q, k, v = (torch.randn(n, heads, dim, generator=gen) for _ in range(3))
        rows = (q, k, v, -torch.rand(n, heads, generator=gen), torch.rand(n, heads, generator=gen))
        pool, slot = torch.zeros(1, heads, dim, dim), torch.tensor([0])
        prompt = (*rows, pool, slot, [n], [0])
        decode = (*(x[:1] for x in rows), pool, slot, [1], [n])
        cells = [
            cpu_ms(gated_delta_rule_rows, prompt, 3),
            cpu_ms(gated_delta_rule_varlen, prompt, 3),
            cpu_ms(gated_delta_rule_rows, decode, 50) * 1000,
            cpu_ms(gated_delta_rule_varlen, decode, 50) * 1000,
        ]
        print(
            f"| {heads} x {dim} x {dim} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[2]:.0f} | {cells[3]:.0f} |"
        )


if __name__ == "__main__":
    main()
