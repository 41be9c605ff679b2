"""The bf12 Triton GEMV (``dgpp.quant.kernels.bf12_gemv``, opt-in by ``DGPP_BF12_TRITON=1``) on a GPU: checked
against x @ W^T of the BF16 matrix it packs (bf12 is lossless, so only the fp32 sum order differs), then
timed at the Qwen3-8B shapes against cuBLAS on the same BF16 matrix (eager ``do_bench``: the escape
fix-up has a host-sized ``repeat_interleave``, so it is not graph-captured). Not a test.

    PYTHONPATH=dgpp-core/src python3 tests/perf/check_bf12_gemv.py
"""

# ruff: noqa: B023
from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = ((4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288))


def main() -> None:
    from triton.testing import do_bench

    from dgpp.quant.bf12 import encode_bf12
    from dgpp.quant.kernels.bf12_gemv import bf12_matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    failed = 0
    for n, k in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        w[3, 17] = 3.0e4  # an escape (exponent far outside the row's window)
        t = encode_bf12(w)
        packed_bytes = sum(v.numel() * v.element_size() for v in t.values())
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = x.float() @ w.float().t()
            got = bf12_matmul(t, x, (n, k)).float()
            rel = ((got - ref).norm() / ref.norm()).item()
            ok = rel < 1e-2
            failed += not ok
            bf12_us = (
                do_bench(lambda: bf12_matmul(t, x, (n, k)), warmup=10, rep=100, return_mode="median") * 1e3
            )
            dense_us = do_bench(lambda: F.linear(x, w), warmup=10, rep=100, return_mode="median") * 1e3
            print(
                f"bf12 {n}x{k} m={m}: rel_err {rel:.2e} {'ok' if ok else 'FAIL'}; {packed_bytes / 1e6:.1f} MB "
                f"packed vs {w.numel() * 2 / 1e6:.1f} MB bf16; bf12 GEMV {bf12_us:.1f} us "
                f"({packed_bytes / bf12_us / 1e3:.0f} GB/s), cuBLAS bf16 {dense_us:.1f} us",
                flush=True,
            )
    print(f"bf12 checks: {2 * len(SHAPES) - failed} ok, {failed} failed", flush=True)


if __name__ == "__main__":
    main()
