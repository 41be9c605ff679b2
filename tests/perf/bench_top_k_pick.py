"""The indexer's top-k pick on a GPU: ``select_top_k`` (torch ``topk`` over the table's width, two cumsums, a
scatter) against ``top_k_rows_triton`` (one program per row, reading only the row's own scores), the same picks.

    python3 tests/perf/bench_top_k_pick.py [--k 2048] [--width 33792] [--rows 1,8,64] [--lens 1024,8192,32768]

Scores are random over the table's width (a decode graph's table spans the pool); each row sees its first
``lens`` of them. Prints us per call (``triton.testing.do_bench`` medians) and whether the picks are equal.
"""

from __future__ import annotations

import argparse

import torch
import triton

from dgpp.kernels.dsa_index import select_top_k
from dgpp.kernels.top_k_rows import top_k_rows_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--width", type=int, default=33792)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--lens", default="1024,8192,32768")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, k {args.k}, table width {args.width}")
    print("| rows | row length | select_top_k us | top_k_rows us | same picks |")
    print("|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        for length in (int(n) for n in args.lens.split(",")):
            scores = torch.randn(rows, args.width, generator=gen, device="cuda")
            lens = torch.full((rows,), length, dtype=torch.int32, device="cuda")
            want, got = select_top_k(scores, lens, args.k), top_k_rows_triton(scores, lens, args.k)
            same = torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
            torch_us = triton.testing.do_bench(lambda s=scores, n=lens: select_top_k(s, n, args.k)) * 1e3
            radix_us = triton.testing.do_bench(lambda s=scores, n=lens: top_k_rows_triton(s, n, args.k)) * 1e3
            print(f"| {rows} | {length} | {torch_us:.1f} | {radix_us:.1f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
