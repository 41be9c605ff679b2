"""A burst's prefill in-process on a GPU: N short prompts in one step (their linears in one fixed-order call, the
default; or each chunk in cuBLAS calls of its own, written in place or merged by copies), against the stock
dispatch (one cuBLAS call over every row, not row-exact) and one prompt of the same total length; also checks that
each prompt's logits are the same bits alone, among 8, among N and beside a long chunk.

    python3 tests/perf/bench_burst_prefill.py [--geometry qwen3-8b] [--prompts 64] [--tokens 128]

Per mode: the engine thread's time to issue the step (``runner.step`` returning) and the step's wall time with the
GPU synchronised, medians of a few repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dgpp.bench.decode import DecodeSession, random_prompts
from dgpp.bench.models import build_pair
from dgpp.engine.work import SeqWork
from dgpp.nn.exact import chunks
from dgpp.policy import overriding


def timed(session: DecodeSession, works: list[SeqWork], reps: int = 5) -> tuple[float, float, torch.Tensor]:
    logits = session.runner.step(works)
    torch.cuda.synchronize()
    issue, wall = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits = session.runner.step(works)
        issue.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
    return statistics.median(issue) * 1e3, statistics.median(wall) * 1e3, logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="qwen3-8b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument(
        "--long", type=int, default=2048, help="a long chunk beside 8 prompts (above exact_group_rows)"
    )
    args = ap.parse_args()
    model, _ = build_pair(args.geometry, "cuda", torch.bfloat16, with_hf=False)
    n, t = args.prompts, args.tokens
    session = DecodeSession(model, n + 1, max(t, args.long) + 16, 16, graph=False)
    prompts = random_prompts(n, t, model.info.vocab_size, 0)
    works = [SeqWork(b, session.tables[b], 0, p) for b, p in enumerate(prompts)]
    rows = []
    issue, wall, grouped = timed(session, works)
    rows.append((f"{n} x {t}, short chunks in one fixed-order call (default)", issue, wall))
    with overriding(exact_group_rows=0):
        issue, wall, in_place = timed(session, works)
        rows.append((f"{n} x {t}, chunks in cuBLAS calls of their own, in place", issue, wall))
        chunks.IN_PLACE = False
        issue, wall, merged = timed(session, works)
        chunks.IN_PLACE = True
        rows.append((f"{n} x {t}, chunks in calls of their own, merged by copies", issue, wall))
    with overriding(exact_routing=False):
        issue, wall, _ = timed(session, works)
    rows.append((f"{n} x {t}, stock dispatch (one cuBLAS call per weight; not row-exact)", issue, wall))
    same = []
    for k in (1, 8):
        issue, wall, few = timed(session, works[:k])
        rows.append((f"{k} x {t} (default)", issue, wall))
        same.append(torch.equal(few, grouped[:k]))
    # 8 prompts beside a long chunk: their rows gathered into the fixed-order call, the long chunk in cuBLAS
    long_prompt = random_prompts(1, args.long, model.info.vocab_size, 1)[0]
    beside = works[:8] + [SeqWork(n, session.tables[n], 0, long_prompt)]
    issue, wall, mixed = timed(session, beside)
    rows.append((f"8 x {t} + 1 x {args.long}", issue, wall))
    _, _, long_alone = timed(session, beside[8:], reps=1)
    same.append(torch.equal(mixed[:8], grouped[:8]) and torch.equal(mixed[8:], long_alone))
    del session
    long = DecodeSession(model, 1, n * t + 16, 16, graph=False)
    issue, wall, _ = timed(long, [SeqWork(0, long.tables[0], 0, [x for p in prompts for x in p])])
    rows.append((f"1 x {n * t}", issue, wall))
    print(
        f"per-chunk calls: in place == merged (logits of {n} prompts, bitwise): {torch.equal(in_place, merged)}"
    )
    print(
        f"grouped: solo, 8 prompts, 8 beside a {args.long}-token chunk == the same prompts among {n} (bitwise): {same}"
    )
    print(
        f"grouped vs per-chunk logits max abs diff (different kernels for 128-row chunks): "
        f"{float((grouped - in_place).abs().max()):.3e}"
    )
    print("| step | issue ms | wall ms |\n|---|---|---|")
    for label, issue, wall in rows:
        print(f"| {label} | {issue:.1f} | {wall:.1f} |")
    if not all(same) or not torch.equal(in_place, merged):
        raise SystemExit("prompt logits depend on the step: NOT row-exact")


if __name__ == "__main__":
    main()
