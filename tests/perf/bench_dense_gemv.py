"""The dense decode GEMV (``dgpp.kernels.gemv``: ``multi_linear_triton`` and the gate/up + SwiGLU pairs) on every
bf16/fp32 decode shape of the DeepSeek-V4-Flash, GLM-5.3, MiMo-V2.6 and Qwen3.5-MoE geometries (and Qwen3-8B's, which must not move), split-K
against the unsplit launch, timed as CUDA-graph replays over rotated weight copies (out of L2) at 1, 8 and 64 rows,
in % of the copy bandwidth measured in the same run. Not a test.

Checks first, per shape: the default launch against F.linear in fp32 (relative error), a row computed alone
bit-identical to the same row inside 8 rows (the 16-row class; a failure fails the run), and to the same row of a
200-row fixed-order call (64-row blocks, printed as a note when it differs: the exact routing assumes it). Then per shape and row count: the unsplit launch
(``split=1``), the rule's split (``gemv_split.split_count`` for this device's SM count) and each ``--splits`` count
(each slice still >= one 256-column step); ``--tiles`` adds (BN, BK, stages) overrides for the shapes with K <= 1024
and more than 8192 outputs (the 1024 -> 32768 query up-projection). A per-geometry line sums the calls of one
decode step of the geometry's first 4 layers (``NAME@4``) at 1 row: unsplit, the rule, the best count per shape.
JSON to $OUT/dense_gemv.json.

    PYTHONPATH=dgpp-core/src:tests/perf python3 tests/perf/bench_dense_gemv.py [--geometries deepseek-v4-flash-8l]
        [--rows 1,8,64] [--splits 2,4,8,16,32] [--tiles 64,256,4:128,256,3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_quant_gemv import copy_bandwidth, timed  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
DEV = "cuda"

# (name, output sizes of one launch, K, dtype, launches per decode step of the first 4 layers (NAME@4)), read
# off the models built on the meta device (hf_config("NAME@4")): each Linear is one launch, fused q/k/v (and
# GDN's qkv|z, b|a) one launch; gate/up pairs take the gate/up kernel (not here). The hyper-connection
# mixer's 24 rows are padded to 32 (dgpp.nn.exact.routing._pad_rows).
SHAPES: dict[str, list[tuple[str, tuple[int, ...], int, torch.dtype, int]]] = {
    "deepseek-v4-flash-8l": [
        ("wq_a", (1024,), 4096, BF16, 4),
        ("wq_b", (32768,), 1024, BF16, 4),
        ("wkv", (512,), 4096, BF16, 4),
        ("wo_b", (4096,), 8192, BF16, 4),
        ("shared down", (4096,), 2048, BF16, 4),
        ("router", (256,), 4096, BF16, 4),
        ("hc fn", (32,), 16384, FP32, 8),
        ("csa compressor", (1024,), 4096, BF16, 2),
        ("hca compressor", (512,), 4096, BF16, 2),
        ("idx compressor", (256,), 4096, BF16, 2),
        ("idx wq_b", (8192,), 1024, BF16, 1),
        ("idx weights", (64,), 4096, BF16, 1),
        ("lm head", (129280,), 4096, BF16, 1),
    ],
    "glm-5.3-12l": [
        ("q_a", (2048,), 6144, BF16, 4),
        ("kv_a", (576,), 6144, BF16, 4),
        ("q_b", (16384,), 2048, BF16, 4),
        ("o", (6144,), 16384, BF16, 4),
        ("idx wq_b", (4096,), 2048, BF16, 3),
        ("idx wk", (128,), 6144, BF16, 3),
        ("idx weights", (32,), 6144, FP32, 3),
        ("dense down", (6144,), 12288, BF16, 3),
        ("shared down", (6144,), 2048, BF16, 1),
        ("router", (256,), 6144, BF16, 1),
        ("lm head", (154880,), 6144, BF16, 1),
    ],
    "mimo-v2.6-flash-8l": [
        ("qkv full", (12288, 1536, 1024), 4096, BF16, 3),
        ("qkv swa", (12288, 768, 512), 4096, BF16, 1),
        ("o", (4096,), 8192, BF16, 4),
        ("dense down", (4096,), 16384, BF16, 1),
        ("router", (256,), 4096, FP32, 3),
        ("lm head", (152576,), 4096, BF16, 1),
    ],
    "qwen3.5-122b-a10b-24l": [
        ("gdn qkv|z", (12288, 8192), 3072, BF16, 3),
        ("gdn b|a", (64, 64), 3072, BF16, 3),
        ("gdn out", (3072,), 8192, BF16, 3),
        ("qkv full", (16384, 512, 512), 3072, BF16, 1),
        ("o", (3072,), 8192, BF16, 1),
        ("shared down", (3072,), 1024, BF16, 4),
        ("router", (256,), 3072, BF16, 4),
        ("lm head", (248320,), 3072, BF16, 1),
    ],
    "qwen3-8b": [
        ("qkv", (4096, 1024, 1024), 4096, BF16, 4),
        ("o", (4096,), 4096, BF16, 4),
        ("down", (4096,), 12288, BF16, 4),
    ],
}


# gate/up + SwiGLU pairs (``gate_up_silu_triton``): (name, intermediate width, K, dtype, launches per NAME@4 step)
GATE_UP: dict[str, list[tuple[str, int, int, torch.dtype, int]]] = {
    "deepseek-v4-flash-8l": [("shared gate/up", 2048, 4096, BF16, 4)],
    "glm-5.3-12l": [("dense gate/up", 12288, 6144, BF16, 3), ("shared gate/up", 2048, 6144, BF16, 1)],
    "mimo-v2.6-flash-8l": [("dense gate/up", 16384, 4096, BF16, 1)],
    "qwen3.5-122b-a10b-24l": [("shared gate/up", 1024, 3072, BF16, 4)],
    "qwen3-8b": [("gate/up", 12288, 4096, BF16, 4)],
}


def entries(geometry: str) -> list[tuple[str, tuple[int, ...], int, torch.dtype, int, bool]]:
    """The geometry's launches: (name, weight rows, K, dtype, calls, gate/up pair)."""
    found = [(*entry, False) for entry in SHAPES[geometry]]
    return found + [(name, (n, n), k, dt, calls, True) for name, n, k, dt, calls in GATE_UP.get(geometry, [])]


def launch(x: torch.Tensor, ws: list[torch.Tensor], pair: bool, split: int | None, tile=None) -> torch.Tensor:
    from dgpp.kernels.gemv import gate_up_silu_triton, multi_linear_triton

    if pair:
        return gate_up_silu_triton(x, ws[0], ws[1], tile=tile, split=split)
    return torch.cat(multi_linear_triton(x, ws, tile=tile, split=split), dim=1)


def reference(x: torch.Tensor, ws: list[torch.Tensor], pair: bool) -> torch.Tensor:
    """fp32 products (SwiGLU of them for a pair)."""
    outs = [F.linear(x.float(), w.float()) for w in ws]
    return F.silu(outs[0]) * outs[1] if pair else torch.cat(outs, dim=1)


def check(geometry: str, name: str, ws, pair: bool, k: int, dtype: torch.dtype, results: dict) -> None:
    """The default launch against the fp32 products; a row alone against the same row among 8 (one row class)
    and inside a 200-row fixed-order call (64-row blocks: what the exact routing relies on across classes)."""
    from dgpp.nn.exact.gemm import fixed_order_gate_up_silu, fixed_order_linear

    x = torch.randn(200, k, device=DEV, dtype=dtype)
    got = launch(x[:8], ws, pair, None).float()
    ref = reference(x[:8], ws, pair)
    rel = ((got - ref).norm() / ref.norm()).item()
    alone = launch(x[3:4].contiguous(), ws, pair, None)
    exact = torch.equal(alone, got.to(dtype)[3:4])
    many = fixed_order_gate_up_silu(x, *ws) if pair else torch.cat(fixed_order_linear(x, ws), dim=1)
    across = torch.equal(alone, many[3:4])
    ok = rel < 2e-2 and exact
    results["checks"].append(
        {
            "geometry": geometry,
            "shape": name,
            "rel_err": rel,
            "row_exact": exact,
            "row_exact_200": across,
            "ok": ok,
        }
    )
    if not ok or not across:
        print(
            f"CHECK {'FAILED' if not ok else 'note'} {geometry} {name}: rel_err={rel:.2e} row alone == row among 8: "
            f"{exact}, == row of a 200-row fixed-order call: {across}",
            flush=True,
        )


def variants(sizes, pair: bool, k: int, sms: int, splits: list[int], tiles: list[tuple[int, int, int]]):
    """(label, split, tile) of each launch timed for a shape: unsplit, the rule's split, the swept counts (outputs
    under twice ``FILLING_COLUMNS``), tile overrides for short-K wide outputs."""
    from dgpp.kernels import gemv_split

    width = sizes[0] if pair else sum(sizes)  # a pair splits by its intermediate width
    rule = gemv_split.split_count(width, k, sms)
    found = [("whole", 1, None), (f"rule S={rule}", rule, None)] if rule > 1 else [("whole=rule", 1, None)]
    if width < 2 * gemv_split.FILLING_COLUMNS:  # wide outputs: the unsplit launch alone
        found += [
            (f"S={s}", s, None) for s in splits if s not in (1, rule) and k // s >= gemv_split.SLICE_ALIGN
        ]
    if k <= 1024 and width > 8192 and not pair:
        found += [(f"tile {t}", 1, t) for t in tiles if all(n % t[0] == 0 for n in sizes)]
    return found


def bench_shape(geometry, entry, rows, sms, copy_bw, args, results) -> dict[str, dict[int, float]]:
    """us per call of each variant at each row count (printed with % of the copy bandwidth)."""
    name, sizes, k, dtype, _, pair = entry
    gen = torch.Generator(device=DEV).manual_seed(0)
    one = [torch.randn(n, k, device=DEV, dtype=dtype, generator=gen) * k**-0.5 for n in sizes]
    nbytes = sum(w.numel() for w in one) * one[0].element_size()
    copies = max(4, min(64, math.ceil((512 << 20) / nbytes)))  # well past the 50 MB L2
    sets = [one] + [[torch.randn_like(w) * k**-0.5 for w in one] for _ in range(copies - 1)]
    check(geometry, name, one, pair, k, dtype, results)
    times: dict[str, dict[int, float]] = {}
    for label, split, tile in variants(sizes, pair, k, sms, args.splits, args.tiles):
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=dtype)
            try:
                sec = timed(lambda i: launch(x, sets[i], pair, split, tile), copies)  # noqa: B023 (runs here)
            except Exception as e:  # a variant that does not compile or fit is reported, not fatal
                print(f"skip {geometry} {name} {label} m={m}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            moved = nbytes + m * (k + (sizes[0] if pair else sum(sizes))) * one[0].element_size()
            pct = 100 * moved / sec / copy_bw
            times.setdefault(label, {})[m] = sec * 1e6
            results["timings"].append(
                {"geometry": geometry, "shape": name, "sizes": sizes, "k": k, "dtype": str(dtype),
                 "rows": m, "variant": label, "us": sec * 1e6, "pct_copy": pct}
            )  # fmt: skip
            print(
                f"{geometry:22s} {name:15s} {'+'.join(map(str, sizes)):>17s} x {k:5d} {str(dtype)[6:]:8s} "
                f"m={m:2d} {label:22s} {sec * 1e6:8.2f} us {pct:5.1f}%",
                flush=True,
            )
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometries", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--splits", default="2,4,8,16,32")
    ap.add_argument(
        "--tiles", default="64,256,4:128,256,3:64,128,4", help="BN,BK,stages overrides, ':'-separated"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    args.splits = [int(s) for s in args.splits.split(",") if s]
    args.tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(":") if t]
    rows = [int(r) for r in args.rows.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {sms} SMs", flush=True)
    copy_bw = copy_bandwidth("cuda")
    results: dict = {"device": torch.cuda.get_device_name(0), "sms": sms, "copy_GBps": copy_bw / 1e9}
    results |= {"checks": [], "timings": [], "steps": []}
    for geometry in args.geometries.split(","):
        whole = rule = best = 0.0
        for entry in entries(geometry):
            times = bench_shape(geometry, entry, rows, sms, copy_bw, args, results)
            at_one = {label: t[rows[0]] for label, t in times.items() if rows[0] in t}
            if not at_one:
                continue
            calls = entry[4]
            unsplit = at_one.get("whole", at_one.get("whole=rule", 0.0))
            ruled = next(
                (t for label, t in at_one.items() if label.startswith(("rule", "whole=rule"))), unsplit
            )
            whole, rule, best = (
                whole + calls * unsplit,
                rule + calls * ruled,
                best + calls * min(at_one.values()),
            )
            print(
                f"best {geometry} {entry[0]} m={rows[0]}: {min(at_one, key=at_one.__getitem__)}", flush=True
            )
        step = {"geometry": geometry, "rows": rows[0], "whole_us": whole, "rule_us": rule, "best_us": best}
        results["steps"].append(step)
        print(
            f"step {geometry}@4 m={rows[0]}: GEMV launches {whole:8.1f} us unsplit, {rule:8.1f} us by the rule, "
            f"{best:8.1f} us with the best variant per shape",
            flush=True,
        )
    with open(os.path.join(args.out, "dense_gemv.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    failed = [c for c in results["checks"] if not c["ok"]]
    print(f"checks: {len(results['checks']) - len(failed)} ok, {len(failed)} failed", flush=True)


if __name__ == "__main__":
    main()
