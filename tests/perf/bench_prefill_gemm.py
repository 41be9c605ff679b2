"""The fixed-order prefill tiles (``dgpp.kernels.gemm_prefill``) on a GPU at the Qwen3-8B shapes: bit identity with
the decode GEMV's rows for each tile in a sweep, and TFLOP/s against cuBLAS and the 64-row GEMV tiles.

    python3 tests/perf/bench_prefill_gemm.py [--rows 512,1024,2048,8192] [--sweep | --small]

``same`` lines: every row of an M-row prefill call against the same rows through the decode GEMV in 64-row calls
(BM 64) and, for a sample, alone (BM 16). ``time`` lines: do_bench medians. Exits non-zero when a tile that the
engine uses is not bit-identical.
"""

# ruff: noqa: B023
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton.testing

from dgpp import kernels
from dgpp.kernels import gemm_prefill
from dgpp.kernels.gemv import gate_up_silu_triton, multi_linear_triton
from dgpp.nn.exact.gemm import fixed_order_gate_up_silu, fixed_order_linear

DEV, BF16 = "cuda", torch.bfloat16
LINEAR_SWEEP = [
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 4, 4, 8),
    (128, 256, 128, 8, 2, 8),
    (256, 128, 64, 8, 3, 8),
]
GATE_UP_SWEEP = [
    (128, 128, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 64, 64, 4, 4, 8),
    (64, 128, 64, 4, 4, 8),
    (128, 128, 128, 8, 2, 8),
]
# tiles for a few hundred rows (one 256-token chunk alone): fewer rows per program so the grid fills the SMs
LINEAR_SMALL = [
    (64, 128, 64, 4, 4, 8),
    (64, 256, 64, 4, 3, 8),
    (128, 128, 64, 8, 4, 8),
    (64, 64, 64, 4, 4, 8),
    (128, 64, 64, 4, 4, 8),
    (256, 128, 64, 8, 3, 8),
]
GATE_UP_SMALL = [
    (64, 128, 64, 4, 4, 8),
    (64, 64, 64, 4, 4, 8),
    (128, 64, 64, 4, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (64, 128, 64, 8, 4, 8),
]
FAILS: list[str] = []


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def gemv_rows(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[a : a + 64]) for a in range(0, x.shape[0], 64)])


def verdict(
    name: str, out: torch.Tensor, ref64: torch.Tensor, solo: list[tuple[int, torch.Tensor]], judged: bool
) -> None:
    bad = [] if torch.equal(out, ref64) else ["BM64 rows"]
    bad += [f"row {r} alone" for r, row in solo if not torch.equal(out[r : r + 1], row)]
    diff = float((out.float() - ref64.float()).abs().max())
    print(
        f"same  {name:58s} {'IDENTICAL' if not bad else f'DIFFERENT ({bad}, max abs {diff:.3e})'}", flush=True
    )
    if bad and judged:
        FAILS.append(name)


def main() -> None:
    rows_list = [
        int(r)
        for r in (
            sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv else "512,1024,2048,8192"
        ).split(",")
    ]
    sweep = "--sweep" in sys.argv or "--small" in sys.argv
    if "--small" in sys.argv:
        LINEAR_SWEEP[:], GATE_UP_SWEEP[:] = LINEAR_SMALL, GATE_UP_SMALL
    torch.manual_seed(0)
    h, i, kv = 4096, 12288, 1024
    table = []
    for name, k, ns in (
        ("qkv 4096->6144", h, [h, kv, kv]),
        ("o 4096->4096", h, [h]),
        ("down 12288->4096", i, [h]),
    ):
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5 for n in ns]
        x = torch.randn(max(rows_list) + 37, k, device=DEV, dtype=BF16)  # a partial last row block
        ref64 = gemv_rows(lambda r: torch.cat(multi_linear_triton(r, ws), 1), x)
        solo = [(r, torch.cat(multi_linear_triton(x[r : r + 1], ws), 1)) for r in (0, 1, 129, x.shape[0] - 1)]
        for tile in LINEAR_SWEEP if sweep else []:
            out = torch.cat(gemm_prefill.prefill_linear(x, ws, tile), 1)
            verdict(
                f"prefill {tile} {name}", out, ref64, solo, tile in {t for _, t in gemm_prefill.LINEAR_TILES}
            )
        engine = torch.cat(fixed_order_linear(x, ws), 1)
        verdict(f"engine fixed_order_linear {name}", engine, ref64, solo, True)
        flop_row = 2 * k * sum(ns)
        for m in rows_list:
            xm = x[:m].contiguous()
            t_cublas = ms(lambda: [F.linear(xm, w) for w in ws])
            t_gemv = ms(lambda: fixed_order_linear(xm, ws, 64))
            engine_tile = gemm_prefill.linear_tile(m)
            tiles = {
                t: ms(lambda t=t: gemm_prefill.prefill_linear(xm, ws, t))
                for t in {*(LINEAR_SWEEP if sweep else []), engine_tile}
            }
            best = min(tiles, key=tiles.get)
            tf = flop_row * m / 1e9
            line = "  ".join(f"{t}: {tf / v:.0f}" for t, v in tiles.items())
            print(
                f"time  {name:18s} M={m:5d} TFLOP/s cuBLAS {tf / t_cublas:.0f}  GEMV BM64 {tf / t_gemv:.0f}  {line}",
                flush=True,
            )
            table.append(
                (name, m, tf / t_cublas, tf / t_gemv, tf / tiles[engine_tile], best, tf / tiles[best])
            )
    wg, wu = (torch.randn(i, h, device=DEV, dtype=BF16) / h**0.5 for _ in range(2))
    x = torch.randn(max(rows_list) + 37, h, device=DEV, dtype=BF16)
    ref64 = gemv_rows(lambda r: gate_up_silu_triton(r, wg, wu), x)
    solo = [(r, gate_up_silu_triton(x[r : r + 1], wg, wu)) for r in (0, 1, 129, x.shape[0] - 1)]
    for tile in GATE_UP_SWEEP if sweep else []:
        verdict(
            f"prefill {tile} gate_up 4096->2x12288",
            gemm_prefill.prefill_gate_up_silu(x, wg, wu, tile),
            ref64,
            solo,
            tile in {t for _, t in gemm_prefill.GATE_UP_TILES},
        )
    verdict("engine fixed_order_gate_up_silu", fixed_order_gate_up_silu(x, wg, wu), ref64, solo, True)
    for m in rows_list:
        xm = x[:m].contiguous()
        t_cublas = ms(lambda: kernels.silu_mul_pair(F.linear(xm, wg), F.linear(xm, wu)))
        t_gemv = ms(lambda: fixed_order_gate_up_silu(xm, wg, wu, 64))
        engine_tile = gemm_prefill.gate_up_tile(m)
        tiles = {
            t: ms(lambda t=t: gemm_prefill.prefill_gate_up_silu(xm, wg, wu, t))
            for t in {*(GATE_UP_SWEEP if sweep else []), engine_tile}
        }
        best = min(tiles, key=tiles.get)
        tf = 2 * h * 2 * i * m / 1e9
        line = "  ".join(f"{t}: {tf / v:.0f}" for t, v in tiles.items())
        print(
            f"time  gate_up 2x12288   M={m:5d} TFLOP/s cuBLAS+silu {tf / t_cublas:.0f}  GEMV BM64 {tf / t_gemv:.0f}  {line}",
            flush=True,
        )
        table.append(
            (
                "gate_up 4096->2x12288",
                m,
                tf / t_cublas,
                tf / t_gemv,
                tf / tiles[engine_tile],
                best,
                tf / tiles[best],
            )
        )
    print(
        "| shape | M | cuBLAS TFLOP/s | GEMV BM64 tiles | engine's prefill tile | best of sweep |\n|---|---|---|---|---|---|"
    )
    for name, m, c, g, p, best, b in table:
        print(f"| {name} | {m} | {c:.0f} | {g:.0f} | {p:.0f} | {b:.0f} {best} |")
    print("FAILED: " + ", ".join(FAILS) if FAILS else "prefill tiles bit-identical to the decode GEMV")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
