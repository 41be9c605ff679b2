"""What every kernel check reports: the relative error against the torch reference and the median times of both,
one row each in ``ROWS`` (written to ``--json`` by ``check_kernels.py``) and one printed line."""

from __future__ import annotations

import math

import torch
import triton.testing

DEV = "cuda"
BF16 = torch.bfloat16
ROWS: list[dict] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def record_times(
    name: str,
    err: float,
    tol: float,
    triton_us: float,
    ref_us: float,
    nbytes: float,
    ref_label: str = "torch",
    note: str = "",
) -> None:
    """One row from times already measured (``ref_label`` names what the reference time ran)."""
    row = {
        "kernel": name,
        "rel_err": err,
        "ok": err <= tol,
        "triton_us": triton_us,
        "torch_us": ref_us,
        "GB/s": nbytes / (triton_us * 1e-6) / 1e9,
    }
    ROWS.append(row)
    print(
        f"{name:44s} err {err:.2e} ({'ok' if row['ok'] else 'FAIL'})  triton {triton_us:9.1f} us  "
        f"{ref_label} {ref_us:9.1f} us  {row['GB/s']:7.0f} GB/s{note}",
        flush=True,
    )


def record(name: str, err: float, tol: float, fast, slow, nbytes: float) -> None:
    """Time ``fast`` (the Triton call) and ``slow`` (its torch reference), then report one row."""
    t_fast = triton.testing.do_bench(fast, warmup=25, rep=100, return_mode="median")
    t_ref = triton.testing.do_bench(slow, warmup=5, rep=40, return_mode="median")
    record_times(name, err, tol, t_fast * 1e3, t_ref * 1e3, nbytes)
