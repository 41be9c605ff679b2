"""The decode GEMV, gate + up + SiLU and the LM head at real sizes on the GPU, timed from CUDA-graph replays over
rotated weights (out of L2), with tile sweeps and the row-tile invariance check."""

# ruff: noqa: B023  (each timing lambda runs before its loop variables move on)

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing
from kernel_checks_record import BF16, DEV, ROWS, record_times, rel_err


def _rotated_us(fn, copies: int) -> float:
    """Median us of one call from CUDA-graph replays of ``copies`` calls over distinct weights (out of L2)."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3 / copies


def check_gemv() -> None:
    from dgpp.kernels import gemv

    rows = (1, 8, 32, 64)
    for n, k in ((4096, 4096), (1024, 4096), (6144, 4096), (4096, 12288)):
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) * k**-0.5 for _ in range(4)]  # rotated: out of L2
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            (out,) = gemv.multi_linear_triton(x, [ws[0]])
            err = rel_err(out, F.linear(x.float(), ws[0].float()))
            t_tri = _rotated_us(lambda: [gemv.multi_linear_triton(x, [w]) for w in ws], len(ws))
            t_ref = _rotated_us(lambda: [F.linear(x, w) for w in ws], len(ws))
            record_times(
                f"gemv M={m} [{n},{k}]",
                err,
                1e-2,
                t_tri,
                t_ref,
                n * k * 2,
                "cuBLAS",
                " (graph replays, weights rotated)",
            )
    # does a row's result depend on the row tile (16 / 32 / 64)? Within one tile it cannot (see gemv docstring)
    x = torch.randn(64, 4096, device=DEV, dtype=BF16)
    w = torch.randn(4096, 4096, device=DEV, dtype=BF16) * 4096**-0.5
    base = gemv.multi_linear_triton(x[:16], [w])[0]
    for m in (1, 8, 17, 32, 64):
        same = torch.equal(gemv.multi_linear_triton(x[:m], [w])[0][: min(m, 16)], base[: min(m, 16)])
        print(f"gemv rows of a {m}-row launch == the 16-row launch bit for bit: {same}", flush=True)
        if m <= 16 and not same:
            ROWS.append(
                {"kernel": f"gemv row invariance M={m}", "ok": False, "error": "rows differ within BM=16"}
            )
    for m, n, k in (
        (1, 4096, 4096),
        (1, 6144, 4096),
        (1, 4096, 12288),
        (32, 6144, 4096),
        (32, 4096, 12288),
        (64, 4096, 4096),
        (64, 6144, 4096),
        (64, 4096, 12288),
    ):  # tile sweep (BN, BK, stages)
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) for _ in range(4)]
        for tile in ((16, 256, 4), (32, 256, 4), (32, 512, 3), (64, 256, 3), (64, 128, 4)):
            try:
                t = _rotated_us(lambda: [gemv.multi_linear_triton(x, [w], tile) for w in ws], len(ws))
            except Exception as e:  # a tile over the shared-memory limit
                print(f"tile {tile} M={m} [{n},{k}]: {type(e).__name__}")
                continue
            print(
                f"gemv sweep M={m} [{n},{k}] tile {tile}: {t:.1f} us, {n * k * 2 / (t * 1e-6) / 1e9:.0f} GB/s",
                flush=True,
            )
    wgs = [torch.randn(12288, 4096, device=DEV, dtype=BF16) * 4096**-0.5 for _ in range(4)]
    wus = [torch.randn(12288, 4096, device=DEV, dtype=BF16) * 4096**-0.5 for _ in range(4)]
    for m in rows:
        x = torch.randn(m, 4096, device=DEV, dtype=BF16)
        out = gemv.gate_up_silu_triton(x, wgs[0], wus[0])
        err = rel_err(out, gemv.gate_up_silu_ref(x.float(), wgs[0].float(), wus[0].float()))
        pairs = list(zip(wgs, wus, strict=True))
        t_tri = _rotated_us(lambda: [gemv.gate_up_silu_triton(x, wg, wu) for wg, wu in pairs], 4)
        t_ref = _rotated_us(lambda: [(F.linear(x, wg), F.linear(x, wu)) for wg, wu in pairs], 4)
        record_times(
            f"gate+up+silu M={m} 2x[12288,4096]", err, 1e-2, t_tri, t_ref, 2 * 12288 * 4096 * 2, "2 cuBLAS"
        )
        for tile in ((32, 256, 3), (16, 256, 3), (64, 256, 2), (32, 128, 4)):
            try:
                t = _rotated_us(lambda: [gemv.gate_up_silu_triton(x, wg, wu, tile) for wg, wu in pairs], 4)
            except Exception as e:
                print(f"gate+up tile {tile} M={m}: {type(e).__name__}")
                continue
            print(
                f"gate+up sweep M={m} tile {tile}: {t:.1f} us, {2 * 12288 * 4096 * 2 / (t * 1e-6) / 1e9:.0f} GB/s",
                flush=True,
            )
    # LM head (151936 x 4096, 1.24 GB): does the GEMV beat cuBLAS (0.33 ms = 3.8 TB/s in the profile)?
    head = torch.randn(151936, 4096, device=DEV, dtype=BF16) * 4096**-0.5
    for m in (1, 64):
        x = torch.randn(m, 4096, device=DEV, dtype=BF16)
        (out,) = gemv.multi_linear_triton(x, [head])
        err = rel_err(out, F.linear(x.float(), head.float()))
        for tile in (None, (64, 256, 4), (128, 256, 3)):
            try:
                t_tri = (
                    triton.testing.do_bench_cudagraph(
                        lambda: gemv.multi_linear_triton(x, [head], tile), rep=50, return_mode="median"
                    )
                    * 1e3
                )
            except Exception as e:
                print(f"lm head tile {tile} M={m}: {type(e).__name__}")
                continue
            t_ref = (
                triton.testing.do_bench_cudagraph(lambda: F.linear(x, head), rep=50, return_mode="median")
                * 1e3
            )
            print(
                f"lm head M={m} [151936,4096] tile {tile}: err {err:.2e} triton {t_tri:.1f} us "
                f"({head.numel() * 2 / (t_tri * 1e-6) / 1e9:.0f} GB/s), cuBLAS {t_ref:.1f} us",
                flush=True,
            )
