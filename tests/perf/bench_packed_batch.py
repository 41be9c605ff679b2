"""Packed FP8 / FP4 linears at serving batch sizes on a GPU, Qwen3-8B layer shapes. Not a test.

1. Row exactness at real sizes: every row of calls of 2..300 rows (bf16) equal to the row computed alone, for the
   tensor-core kernel (16-row blocks up to 16 rows, 64-row blocks above), q/k/v, o, gate/up + SwiGLU and down.
2. Error of the 64-row call against the decode-then-multiply reference (fp32 products of the decoded weights).
3. Per-layer time (CUDA-graph replays over rotated weight copies, out of L2) at 1, 8, 16, 64, 128, 256 rows of:
   ``batch`` (the one-launch tensor-core kernel), ``mma16`` (the same kernel in launches of 16 rows: what a
   server ran before above 16 rows), ``row16`` (the CUDA-core row GEMV in launches of 16 rows: what
   ``dgpp bench`` ran) and ``bf16`` (the dense canonical kernels, ``dgpp.nn.exact.gemm``, on bf16 weights of the
   same shapes), each with % of the copy bandwidth for the bytes a call must read (weights once + x + out).
4. ``--sweep``: batch-tile variants at 64 rows.
5. ``--tiles``: decode-tile variants (``TILE_VARIANTS``: scales loaded a step ahead, FP4 scales as 32-bit words,
   FP4 x split by every warp in every K step, or once per launch, for the decode tile and its candidates alike;
   FP4 with the weights as the MMA's A operand),
   each timed at 1 and 16 rows, and every 64-row candidate of each (``batch_candidates``) timed at 64 rows with
   its rows checked bit for bit against the variant's 16-row launches (a candidate that is not row-exact is
   reported, as the run-time probe would skip it).

    PYTHONPATH=dgpp-core/src python3 tests/perf/bench_packed_batch.py [--formats fp8_block,nvfp4] [--rows 1,8,16,64]
"""
# ruff: noqa: B023  (timing lambdas run inside the loop iteration that defines them)

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch
from bench_quant_gemv import PROBLEMS, copy_bandwidth, formats, nbytes, random_weight, reference, timed

EXACT_ROWS = (2, 16, 17, 64, 65, 300)


def launch(fmt, kind, sets, shapes, x, tile=None, batch=None, chunk=0):
    """One call of the problem through the tensor-core kernel (``chunk``: launches of that many rows)."""
    from dgpp.quant.kernels import quant_gate_up_silu, quant_multi_linear

    if chunk and x.shape[0] > chunk:
        return torch.cat(
            [
                launch(fmt, kind, sets, shapes, x[i : i + chunk], tile, batch)
                for i in range(0, x.shape[0], chunk)
            ]
        )
    if kind == "gate_up":
        return quant_gate_up_silu(fmt, sets[0], sets[1], x, shapes[0], tile, batch)
    return torch.cat(quant_multi_linear(fmt, sets, x, shapes, tile, batch), dim=1)


def decode_tile(fmt, kind, shapes):
    from dgpp.quant.kernels import default_tile

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, per = (sum(s[0] for s in shapes), 1) if kind == "multi" else (2 * shapes[0][0], 2)
    return default_tile(fmt, rows, shapes[0][1], sms, per)


def row_tile(fmt):
    from dgpp.quant.kernels.row_launch import default_row_tile, row_supported

    return default_row_tile(fmt, 0, 0) if row_supported(fmt, (4096, 4096)) else None


def dense_call(kind, weights, x):
    from dgpp.nn.exact.gemm import fixed_order_gate_up_silu, fixed_order_linear

    if kind == "gate_up":
        return fixed_order_gate_up_silu(x, weights[0], weights[1])
    return torch.cat(fixed_order_linear(x, weights), dim=1)


def check_exact(name, fmt, pname, kind, sets, shapes, tile, results) -> bool:
    x = torch.randn(300, shapes[0][1], device="cuda", dtype=torch.bfloat16)
    alone = torch.cat([launch(fmt, kind, sets, shapes, x[i : i + 1], tile) for i in range(300)])
    bad = {}
    for m in EXACT_ROWS:
        got = launch(fmt, kind, sets, shapes, x[:m], tile)
        rows = (got != alone[:m]).any(dim=1).nonzero().flatten().tolist()
        if rows:
            bad[m] = rows[:4]
    got = launch(fmt, kind, sets, shapes, x[:64], tile).float()
    ref = reference(fmt, kind, sets, shapes, x[:64])
    rel = ((got - ref).norm() / ref.norm()).item()
    ok = not bad and math.isfinite(rel) and rel < (2e-2 if kind == "gate_up" else 1e-2)
    from dgpp.quant.kernels.batch_probe import _EXACT_BATCH

    shape_key = tuple(shapes) if kind == "multi" else shapes[0]
    chosen = [v for key, v in _EXACT_BATCH.items() if key[:3] == (kind, fmt, shape_key)]
    tile = (
        "16-row launches"
        if not chosen or chosen[-1] is None
        else (
            f"64-row blocks bn={chosen[-1].bn} bk={chosen[-1].bk} warps={chosen[-1].warps} w_as_a={chosen[-1].w_as_a}"
        )
    )
    results["checks"].append(
        {
            "format": name,
            "problem": pname,
            "mismatched_rows": bad,
            "rel_err": rel,
            "ok": ok,
            "above_16_rows": tile,
        }
    )
    print(
        f"exact {name:11s} {pname:8s} rows of 1..300-row calls == alone: {not bad} {bad or ''} "
        f"rel_err(64 rows)={rel:.2e} above 16 rows: {tile} {'ok' if ok else 'FAIL'}",
        flush=True,
    )
    return ok


def time_problem(
    name, fmt, pname, kind, shapes, rows_list, copy_bw, gen, results, sweep, tiles=False
) -> dict:
    one = [random_weight(fmt, s, "cuda", gen) for s in shapes]
    wbytes = nbytes(one)
    copies = max(4, min(16, math.ceil((512 << 20) / wbytes)))
    sets = [one] + [[random_weight(fmt, s, "cuda", gen) for s in shapes] for _ in range(copies - 1)]
    dense = [
        [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for s in shapes]
        for _ in range(max(4, copies // 2))
    ]
    tile = decode_tile(fmt, kind, shapes)
    rtile = row_tile(fmt)
    check_exact(name, fmt, pname, kind, one, shapes, tile, results)
    out_n = shapes[0][0] if kind == "gate_up" else sum(s[0] for s in shapes)
    k = shapes[0][1]
    per = {}
    for m in rows_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        io = 2 * m * (k + out_n)
        variants = {
            "batch": lambda i: launch(fmt, kind, sets[i], shapes, x, tile),
            "mma16": lambda i: launch(fmt, kind, sets[i], shapes, x, tile, chunk=16),
            "bf16": lambda i: dense_call(kind, dense[i % len(dense)], x),
        }
        if rtile is not None and m <= 64:
            variants["row16"] = lambda i: launch(fmt, kind, sets[i], shapes, x, rtile, chunk=16)
        for vname, fn in variants.items():
            if vname == "mma16" and m <= 16:
                continue  # the same launch as batch
            nb = (2 * sum(s[0] * s[1] for s in shapes) if vname == "bf16" else wbytes) + io
            try:
                sec = timed(fn, copies if vname != "bf16" else len(dense))
            except Exception as e:  # reported, not fatal
                print(f"skip {name} {pname} m={m} {vname}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            pct = 100 * nb / sec / copy_bw
            per[(vname, m)] = sec
            results["timings"].append(
                {
                    "format": name,
                    "problem": pname,
                    "variant": vname,
                    "m": m,
                    "us": sec * 1e6,
                    "bytes": nb,
                    "pct_copy": pct,
                }
            )
            print(
                f"time {name:11s} {pname:8s} m={m:3d} {vname:6s} {sec * 1e6:8.1f} us {pct:5.1f}% of copy bw",
                flush=True,
            )
    if sweep:
        sweep_batch_tiles(name, fmt, pname, kind, sets, shapes, tile, copies, results)
    if tiles:
        sweep_tile_variants(name, fmt, pname, kind, sets, shapes, tile, copies, results)
    return per


TILE_VARIANTS = {
    "default": {},
    "scales_in_step": {"scales_ahead": False},
    "scales_ahead": {"scales_ahead": True},
    "scale_words": {"fp4_scales": "words", "scales_ahead": False},  # FP4 only
    # FP4 only, the decode tile and its 64-row candidates alike: x's even/odd columns split by every warp in every
    # K step (as before the 64-row candidates read it split once per launch), or once per launch everywhere
    "x_split_step": {"x_split": "step"},
    "x_split_launch": {"x_split": "launch"},
    # the weights as the MMA's A operand: on 8 warps Triton issues wgmma at 16 rows too, so its one-dot 64-row
    # candidate may round as the 16-row tile does (the sweep's exact= says); under DISABLE_MMA_V3=1 every tile is
    # mma.sync, so the sweep then says what the 64-row tiles give on the decode tile's instruction
    "weights_as_a": {"w_as_a": True},
}


def sweep_tile_variants(name, fmt, pname, kind, sets, shapes, tile, copies, results) -> None:
    """``--tiles``: each decode-tile variant at 1 and 16 rows (``same_bits``: its 16-row launch has the default
    tile's bits), then each of its 64-row candidates at 64 rows (row-exact against the variant's 16-row launches
    or not)."""
    from dgpp.quant.fp4 import FP4Grouped
    from dgpp.quant.kernels.decode_launch import batch_candidates

    k = shapes[0][1]
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    seen = set()
    for vname, change in TILE_VARIANTS.items():
        dec = dataclasses.replace(tile, **change)
        fp4_only = "fp4_scales" in change or "x_split" in change
        if (fp4_only and not isinstance(fmt, FP4Grouped)) or dec in seen:
            continue  # FP4 only, or the same tile as an earlier variant
        seen.add(dec)
        same = torch.equal(
            launch(fmt, kind, sets[0], shapes, x[:16], dec), launch(fmt, kind, sets[0], shapes, x[:16], tile)
        )
        runs = [(f"decode m={m} same_bits={same}", x[:m], None) for m in (1, 16)]
        want = launch(fmt, kind, sets[0], shapes, x, dec, chunk=16)
        for i, b in enumerate(batch_candidates(fmt, dec, shapes[0])):
            if "x_split" in change:
                b = dataclasses.replace(b, x_split=change["x_split"])
            try:
                exact = torch.equal(launch(fmt, kind, sets[0], shapes, x, dec, b), want)
            except Exception as e:  # reported, not fatal
                print(f"tiles skip {name} {pname} {vname} batch{i}: {type(e).__name__}: {str(e)[:120]}")
                continue
            runs.append((f"batch{i} m=64 exact={exact}", x, b))
        for label, rows, b in runs:
            try:
                sec = timed(lambda i: launch(fmt, kind, sets[i], shapes, rows, dec, b), copies)
            except Exception as e:
                print(f"tiles skip {name} {pname} {vname} {label}: {type(e).__name__}: {str(e)[:120]}")
                continue
            shown = (
                ""
                if b is None
                else f" bn={b.bn} bk={b.bk} warps={b.warps} blocks={b.row_blocks} w_as_a={b.w_as_a}"
            )
            results["tiles"].append(
                {
                    "format": name,
                    "problem": pname,
                    "variant": vname,
                    "run": label,
                    "us": sec * 1e6,
                    "tile": dataclasses.asdict(b or dec),
                }
            )
            print(
                f"tiles {name:11s} {pname:8s} {vname:12s} {label:28s} {sec * 1e6:8.1f} us{shown}", flush=True
            )


def sweep_batch_tiles(name, fmt, pname, kind, sets, shapes, tile, copies, results) -> None:
    from dgpp.quant.kernels.decode_launch import default_batch_tile

    base = default_batch_tile(fmt, tile, shapes[0])
    variants = [
        base,
        dataclasses.replace(base, w_as_a=False),
        dataclasses.replace(base, stages=base.stages - 1),
        dataclasses.replace(base, bn=128, warps=8),
        dataclasses.replace(base, warps=8),
    ]
    if base.bn == 128:
        variants.append(dataclasses.replace(base, bn=64, warps=4))
    x = torch.randn(64, shapes[0][1], device="cuda", dtype=torch.bfloat16)
    for b in dict.fromkeys(variants):
        try:
            sec = timed(lambda i: launch(fmt, kind, sets[i], shapes, x, tile, b), copies)
        except Exception as e:
            print(f"sweep skip {name} {pname} {b}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        results["sweep"].append(
            {"format": name, "problem": pname, "tile": dataclasses.asdict(b), "us": sec * 1e6}
        )
        print(
            f"sweep {name:11s} {pname:8s} m=64 {sec * 1e6:8.1f} us bn={b.bn} bk={b.bk} warps={b.warps} "
            f"stages={b.stages} w_as_a={b.w_as_a}",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp8_block,nvfp4,fp8_channel,mxfp4")
    ap.add_argument("--rows", default="1,8,16,64,128,256")
    ap.add_argument("--problems", default=",".join(PROBLEMS), help="subset of " + ",".join(PROBLEMS))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="decode-tile variants and their 64-row candidates")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = {"device": torch.cuda.get_device_name(), "checks": [], "timings": [], "sweep": [], "tiles": []}
    copy_bw = copy_bandwidth("cuda")
    table = []
    for name in args.formats.split(","):
        fmt = formats()[name]
        layer = {}
        for pname in args.problems.split(","):
            kind, shapes = PROBLEMS[pname]
            for key, sec in time_problem(
                name,
                fmt,
                pname,
                kind,
                shapes,
                rows_list,
                copy_bw,
                gen,
                results,
                args.sweep and pname in ("o", "gate_up"),
                args.tiles,
            ).items():
                layer[key] = layer.get(key, 0.0) + sec
        for m in rows_list:
            cells = [
                f"{layer[(v, m)] * 1e6:.1f}" if (v, m) in layer else "-"
                for v in ("batch", "mma16", "row16", "bf16")
            ]
            table.append(f"| {name} | {m} | " + " | ".join(cells) + " |")
    with open(os.path.join(args.out, "packed_batch.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    failed = [c for c in results["checks"] if not c["ok"]]
    print("\n| format | rows | batch (us/layer) | mma16 | row16 | bf16 |\n|---|---|---|---|---|---|")
    print("\n".join(table))
    print(f"checks: {len(results['checks']) - len(failed)} ok, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
