"""One CPU decode step of the demo's SmolLM2-135M in process: milliseconds and torch ops a step
(docs/benchmarks.md, "CPU decode step"), or a verify step of several rows (``--rows``: the last token and
``rows - 1`` drafts, every row's logits, as a speculative verify runs them; "CPU demo: prompt-lookup drafts").

    python tests/perf/bench_cpu_step.py [--dtypes float32,bfloat16] [--threads 1,2] [--steps 32] [--context 200]
                                        [--gguf-weights decoded,int4pack] [--rows 1,2,4,6]

Loads the demo checkpoint (the GGUF converted as ``dgpp serve`` converts it) through its family plugin, runs
one prompt of ``--context`` tokens through ``ModelRunner.step``, then single-row decode steps (greedy, the
argmax fed back). A step's time as process CPU time (on a machine shared with other work, wall time measures
the other work too; with 2 threads it sums both) and as wall time; min and median of ``--steps`` steps. Ops a step: ``torch.profiler`` events
(every aten op, nested ones counted) and the ops Python dispatches (top-level), over one step.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "perf"))


def measure(
    checkpoint: Path,
    dtype: torch.dtype,
    threads: int,
    steps: int,
    context: int,
    gguf_weights: str = "decoded",
    rows: int = 1,
) -> dict[str, float]:
    from dgpp.config_schema import EngineConfig
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.startup.loading import load_model
    from dgpp.step.pools import CachePools
    from dgpp.testing.dispatched_ops import DispatchedOps

    torch.set_num_threads(threads)
    model = load_model(checkpoint, EngineConfig(gguf_weights=gguf_weights), dtype=dtype)
    block_size = 16
    blocks = -(-(context + steps + 16) // block_size)
    runner = ModelRunner(model, CachePools(model.cache_spec(), blocks, block_size, 1))
    table = list(range(blocks))
    prompt = [(7 * i) % 40000 + 100 for i in range(context)]
    state = {"ctx": context, "tok": int(runner.step([SeqWork(0, table, 0, prompt)])[0].argmax())}

    def step() -> None:
        tokens = [state["tok"], *prompt[: rows - 1]]  # rows past the first: drafts, judged on their logits
        work = SeqWork(0, table, state["ctx"], tokens, every_row_logits=rows > 1)
        logits = runner.step([work], verify=rows > 1)
        state["ctx"] += 1
        state["tok"] = int(logits[0].argmax())

    for _ in range(4):  # first products check their shapes and pack their weights
        step()
    times, walls = [], []
    for _ in range(steps):
        start, wall = time.process_time(), time.perf_counter()
        step()
        times.append((time.process_time() - start) * 1000.0)
        walls.append((time.perf_counter() - wall) * 1000.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counter = DispatchedOps()
    with counter:
        step()
    return {
        "min_ms": min(times),
        "median_ms": statistics.median(times),
        "wall_min_ms": min(walls),
        "wall_median_ms": statistics.median(walls),
        "profiler_ops": len(prof.events()),
        "dispatched_ops": counter.count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument(
        "--gguf-weights", default="decoded", help="engine.gguf_weights values, comma-separated"
    )
    parser.add_argument(
        "--rows", default="1", help="rows a step, comma-separated (more than 1: a verify step)"
    )
    args = parser.parse_args()
    from bench_cpu_serve import demo_gguf

    from dgpp.checkpoint.gguf_convert import ensure_converted

    checkpoint = ensure_converted(demo_gguf())
    print(f"torch {torch.__version__}, context {args.context}, {args.steps} decode steps")
    print(
        "| weights | gguf_weights | threads | rows | CPU ms a step (min / median) | wall ms a step (min / median) | aten ops a step ",
        end="",
    )
    print("(profiler / dispatched) |")
    print("|---|---|---|---|---|---|---|")
    for dtype, gguf_weights, threads, rows in itertools.product(
        args.dtypes.split(","),
        args.gguf_weights.split(","),
        [int(t) for t in args.threads.split(",")],
        [int(r) for r in args.rows.split(",")],
    ):
        r = measure(checkpoint, getattr(torch, dtype), threads, args.steps, args.context, gguf_weights, rows)
        print(
            f"| {dtype} | {gguf_weights} | {threads} | {rows} | {r['min_ms']:.1f} / {r['median_ms']:.1f} | "
            f"{r['wall_min_ms']:.1f} / {r['wall_median_ms']:.1f} | "
            f"{r['profiler_ops']:,} / {r['dispatched_ops']:,} |"
        )


if __name__ == "__main__":
    main()
