"""Where a decode step's GPU time goes: per-kernel durations from the torch profiler (CUPTI).

Kernels are read from the profiler's chrome trace (``cat == "kernel"``), summed per name over a few
decode steps and divided by the step count. Comparing the per-step kernel sum with the graph replay
time separates kernel time from launch gaps.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

import torch

from dgpp.bench.decode import PREFILL_STEP_TOKENS, DecodeSession, random_prompts
from dgpp.step.model import Model


def _short(name: str) -> str:
    lowered = name.lower()
    if any(tag in lowered for tag in ("gemm", "gemv", "cutlass", "sm90_xmma", "cublas", "splitk")):
        return "GEMM/GEMV (cuBLAS): " + name[:60]
    return name[:80]


def kernel_breakdown(
    model: Model, batch: int, prompt: int, *, graph: bool, steps: int = 5, kv_dtype: str = "auto"
) -> tuple[float, list]:
    """(kernel microseconds per step, [(kernel, launches per step, us per step)] largest first), the cache
    stored as ``kv_dtype`` says."""
    session = DecodeSession(model, batch, prompt + steps + 4, 16, graph, kv_dtype)
    first = session.prefill(random_prompts(batch, prompt, model.info.vocab_size, 0), PREFILL_STEP_TOKENS)
    session.decode(first, prompt, 2)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        session.decode(first, prompt, steps)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in events:
        if ev.get("cat") == "kernel":
            key = _short(ev.get("name", "?"))
            total[key] += float(ev.get("dur", 0.0))
            count[key] += 1
    rows = sorted(((k, count[k] / steps, total[k] / steps) for k in total), key=lambda r: -r[2])
    return sum(total.values()) / steps, rows


def format_breakdown(label: str, per_step_us: float, rows: list, top: int = 14) -> str:
    lines = [
        f"### {label}: kernel time {per_step_us / 1e3:.2f} ms/step",
        "",
        "| kernel | launches/step | us/step | share |",
        "|---|---|---|---|",
    ]
    for name, n, us in rows[:top]:
        lines.append(f"| `{name}` | {n:.0f} | {us:.0f} | {100 * us / per_step_us:.1f}% |")
    rest = sum(us for _, _, us in rows[top:])
    if rest:
        lines.append(
            f"| (other {len(rows) - top} kernels) | | {rest:.0f} | {100 * rest / per_step_us:.1f}% |"
        )
    return "\n".join(lines)
