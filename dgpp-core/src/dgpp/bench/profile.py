"""Where a decode step's (or a prefill's) GPU time goes: per-kernel durations from the torch profiler (CUPTI).

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

from dgpp.bench.decode import PREFILL_STEP_TOKENS, DecodeSession, random_prompts, warm_prefill_session
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
    rows = _kernel_rows(lambda: session.decode(first, prompt, steps), steps)
    return sum(us for _, _, us in rows), rows


def prefill_breakdown(model: Model, tokens: int, kv_dtype: str = "auto") -> tuple[float, list]:
    """(kernel microseconds, [(kernel, launches, us)] largest first) of one eager prefill of ``tokens`` tokens in one
    step, after a warm-up prefill of the same prompt."""
    session, prompt = warm_prefill_session(model, tokens, kv_dtype=kv_dtype)
    rows = _kernel_rows(lambda: session.prefill(prompt), 1)
    return sum(us for _, _, us in rows), rows


def _kernel_rows(run, repeats: int) -> list:
    """[(kernel, launches per repeat, us per repeat)] of ``run()``'s CUDA kernels, largest first (``repeats``: how
    many steps ``run`` makes)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
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
    return sorted(((k, count[k] / repeats, total[k] / repeats) for k in total), key=lambda r: -r[2])


def format_breakdown(label: str, per_step_us: float, rows: list, top: int = 14, per: str = "/step") -> str:
    """A markdown table of ``rows`` (``per``: what the times are per, "" for one prefill)."""
    lines = [
        f"### {label}: kernel time {per_step_us / 1e3:.2f} ms{per}",
        "",
        f"| kernel | launches{per} | us{per} | share |",
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
