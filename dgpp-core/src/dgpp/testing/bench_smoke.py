"""``dgpp bench`` run end to end on a tiny geometry on CPU, as a plugin's bench-geometry test runs it."""

from __future__ import annotations

import contextlib
import io


def bench_on_cpu(geometry: str, cases: str, check_case: str, hf_cases: str = "") -> str:
    """Run ``dgpp bench --device cpu`` over ``cases`` and return what it printed, after checking it exited 0, named
    the geometry and decoded the same greedy tokens through the padded graph batch as eagerly for
    ``check_case``."""
    from dgpp.bench.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(
            ["--device", "cpu", "--geometry", geometry, "--cases", cases]
            + ["--hf-cases", hf_cases, "--check-cases", check_case]
        )
    out = printed.getvalue()
    assert rc == 0, out
    assert f"greedy graph == eager for {check_case}: True" in out and f"geometry {geometry}" in out, out
    return out
