"""int4 ``pack-quantized`` words on a GPU: the PTX decode with a bf16 multiply (``INT4_BF16``) against the fp32
decode it replaces, in the row-exact int GEMM (``int_rows``) and the fused expert GEMM. Not a test.

1. Bit for bit: every output of 1..300-row calls (dense) and of 1 / 8 / 64-token expert layers (GLM-5.3's expert
   shape: hidden 6144, intermediate 2048, 256 experts, top 8) equal between the two paths, and a row alone equal
   to the same row in a batch.
2. Time of each path (CUDA-graph replays over rotated weight copies / routings), and the new path's share of the
   copy bandwidth for the packed bytes it reads.

    python3 tests/perf/check_int4_bf16.py

The path is the policy's ``int4_ptx`` (on by default, ``DGPP_INT4_PTX=0`` off); this script turns it on and off
itself. A model's A/B is the same command with and without ``DGPP_INT4_PTX=0``, e.g. ``tests/perf/check_glm5_cuda.py``.
"""
# ruff: noqa: B023  (timing lambdas run inside the loop iteration that defines them)

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from dgpp.policy import current, install
from dgpp.quant.intq import IntPacked
from dgpp.quant.kernels import int_rows_launch

FMT = IntPacked(bits=4, group=64)


def use_ptx(on: bool) -> None:
    """The process's policy with (``on``) or without the PTX decode."""
    install(dataclasses.replace(current(), int4_ptx=on))


def both(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    use_ptx(False)
    old = fn()
    use_ptx(True)
    return old, fn()


def timed_both(fn: Callable[[], object], per: int) -> dict[bool, float]:
    """Microseconds per call of ``fn`` (covering ``per`` calls) without and with the PTX path: graph replays."""
    from triton.testing import do_bench_cudagraph

    out = {}
    for on in (False, True):
        use_ptx(on)
        fn()
        out[on] = do_bench_cudagraph(fn, return_mode="median") * 1e3 / per
    return out


def dense(copy_bw: float, gen: torch.Generator, failures: list[str]) -> None:
    for n, k in ((6144, 6144), (24576, 6144), (2048, 6144)):
        copies = [
            {
                "weight_packed": torch.randint(
                    -(2**31), 2**31 - 1, (n, k // 8), generator=gen, device="cuda", dtype=torch.int32
                ),
                "weight_scale": (torch.rand(n, k // 64, generator=gen, device="cuda") * 2e-3 + 1e-3).to(
                    torch.bfloat16
                ),
            }
            for _ in range(4)
        ]
        nbytes = sum(t.numel() * t.element_size() for t in copies[0].values())
        x = torch.randn(300, k, generator=gen, device="cuda").to(torch.bfloat16)
        for m in (1, 2, 16, 17, 64, 65, 300):
            old, new = both(lambda: int_rows_launch.int_rows_linear(FMT, copies[0], x[:m], (n, k)))
            alone = int_rows_launch.int_rows_linear(FMT, copies[0], x[m - 1 : m], (n, k))
            if not (torch.equal(old, new) and torch.equal(new[m - 1], alone[0])):
                failures.append(
                    f"int_rows {n}x{k}, {m} rows: PTX != fp32 decode, or the last row alone differs"
                )
        cells = []
        for m in (1, 16, 64):
            rows = x[:m].contiguous()
            t = timed_both(lambda: [int_rows_launch.int_rows_linear(FMT, c, rows, (n, k)) for c in copies], 4)
            share = 100 * nbytes / (t[True] * 1e-6) / copy_bw
            cells.append(f"{m} rows {t[False]:.1f} -> {t[True]:.1f} us ({share:.0f} % copy bw)")
        print(f"int_rows int4_g64 {n}x{k}: " + "; ".join(cells), flush=True)


def experts(copy_bw: float, failures: list[str]) -> None:
    import check_quant_moe as q

    from dgpp.quant.moe import QuantExperts

    with torch.device("cuda"):
        moe = QuantExperts(FMT, 256, 6144, 2048)
    q.fill_random(moe)
    fused = q.layer(moe, None)
    for tokens in (1, 8, 64):
        x = torch.randn(tokens, 6144, device="cuda", dtype=torch.bfloat16)
        routes = q.routings(tokens, 256, 8, 8)
        old, new = both(lambda: fused(x, *routes[0]))
        alone = fused(x[:1], routes[0][0][:1], routes[0][1][:1])
        if not (torch.equal(old, new) and torch.equal(alone[0], new[0])):
            failures.append(f"experts, {tokens} tokens: PTX != fp32 decode, or token 0 alone differs")
        used = sum(r[1].unique().numel() for r in routes) / len(routes)
        t = timed_both(lambda: [fused(x, a, b) for a, b in routes], len(routes))
        nbytes = used * q.expert_bytes(moe)
        before, after = (100 * nbytes / (t[on] * 1e-6) / copy_bw for on in (False, True))
        print(
            f"experts int4_g64 6144/2048, {tokens} tokens ({used:.0f} experts): {t[False]:.1f} -> {t[True]:.1f} us "
            f"({before:.0f} -> {after:.0f} % copy bw)",
            flush=True,
        )


def main() -> int:
    from triton.testing import do_bench

    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_bw = 2 * src.numel() / (do_bench(lambda: src.clone(), return_mode="median") * 1e-3)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    failures: list[str] = []
    dense(copy_bw, gen, failures)
    experts(copy_bw, failures)
    print(
        "\n".join(failures) or "PTX decode == fp32 decode bit for bit, rows alone == in a batch: every case"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
