"""Every Triton kernel at real sizes on the GPU: error against its torch reference on fresh random
inputs (outputs poisoned first), and median time of both (triton.testing.do_bench).

Run on a CUDA machine: ``python tests/perf/check_kernels.py [--json out.json] [--only gemv,attention]``. Not a CI
test. The checks live by kernel group in ``kernel_checks_*.py`` beside this script and report through
``kernel_checks_record``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from kernel_checks_attention import (
    check_attention,
    check_kv_fp8_decode_attention,
    check_prefill_attention,
    check_sink_decode_attention,
)
from kernel_checks_gdn import check_gated_delta
from kernel_checks_gemv import check_gemv
from kernel_checks_moe import check_moe
from kernel_checks_record import ROWS
from kernel_checks_router import check_router
from kernel_checks_rowwise import check_rmsnorm, check_rotary_swiglu_kvwrite, check_sampling

CHECKS = (
    check_rmsnorm,
    check_rotary_swiglu_kvwrite,
    check_attention,
    check_prefill_attention,
    check_sink_decode_attention,
    check_kv_fp8_decode_attention,
    check_sampling,
    check_gated_delta,
    check_gemv,
    check_moe,
    check_router,
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="")
    names = ",".join(c.__name__.removeprefix("check_") for c in CHECKS)
    parser.add_argument("--only", default="", help=f"comma-separated check names out of {names}")
    args = parser.parse_args()
    torch.manual_seed(0)
    checks = CHECKS
    if args.only:
        checks = tuple(c for c in checks if c.__name__.removeprefix("check_") in args.only.split(","))
    for check in checks:
        try:
            check()
        except Exception as e:  # keep going: one broken kernel must not hide the others' numbers
            ROWS.append({"kernel": check.__name__, "ok": False, "error": repr(e)})
            print(f"{check.__name__} FAILED: {e!r}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    bad = [r["kernel"] for r in ROWS if not r["ok"]]
    print(f"\nkernel checks: {len(ROWS) - len(bad)}/{len(ROWS)} ok" + (f"; failing: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
