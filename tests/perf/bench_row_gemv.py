"""The CUDA-core row GEMV (``dgpp.quant.kernels.row_gemv``) against the MMA decode GEMV on a GPU at 8B geometry.

Checks first (every format, every 8B problem): the result against the torch decode at m = 1, 3, 16; each of
16 rows bit-identical to the same row computed alone and inside 2 and 5 rows (MTP verify == decode); the
E2M1 -> fp32 PTX decoder on all 256 bytes. Then graph-replay timings over rotated weight copies (out of L2) at
m = 1 (row tiles swept for ``--sweep`` formats) and m = 4, 16 (default tiles), printed with % of the copy
bandwidth measured in the same run; JSON to $OUT/row_gemv.json. Not a test.

    PYTHONPATH=dgpp-core/src python3 tests/perf/bench_row_gemv.py [--formats nvfp4,fp8_block] [--sweep nvfp4]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_quant_gemv import (  # noqa: E402
    LAYERS_8B,
    PROBLEMS,
    copy_bandwidth,
    formats,
    nbytes,
    random_weight,
    reference,
    timed,
)


def run(fmt, kind, sets, shapes, x, tile):
    from dgpp.quant.kernels import quant_gate_up_silu, quant_multi_linear

    if kind == "gate_up":
        return quant_gate_up_silu(fmt, sets[0], sets[1], x, shapes[0], tile)
    return torch.cat(quant_multi_linear(fmt, sets, x, shapes, tile), dim=1)


def run_copy(fmt, kind, sets, shapes, x, tile, i):
    return run(fmt, kind, sets[i], shapes, x, tile)


def check_decoder(results) -> None:
    """The word decoders (E2M1 x 8 and E4M3 x 4 per int32) on every byte value in every position."""
    import triton
    import triton.language as tl

    from dgpp.quant.kernels.e2m1_asm import e2m1_word_fp32
    from dgpp.quant.kernels.e4m3_asm import e4m3_word_fp32

    @triton.jit
    def probe(words_ptr, fp4_ptr, fp8_ptr):
        offs = tl.arange(0, 256)
        words = tl.load(words_ptr + offs)
        n0, n2, n4, n6, n1, n3, n5, n7 = e2m1_word_fp32(words)
        tl.store(fp4_ptr + offs * 8 + 0, n0)
        tl.store(fp4_ptr + offs * 8 + 1, n1)
        tl.store(fp4_ptr + offs * 8 + 2, n2)
        tl.store(fp4_ptr + offs * 8 + 3, n3)
        tl.store(fp4_ptr + offs * 8 + 4, n4)
        tl.store(fp4_ptr + offs * 8 + 5, n5)
        tl.store(fp4_ptr + offs * 8 + 6, n6)
        tl.store(fp4_ptr + offs * 8 + 7, n7)
        b0, b1, b2, b3 = e4m3_word_fp32(words)
        tl.store(fp8_ptr + offs * 4 + 0, b0)
        tl.store(fp8_ptr + offs * 4 + 1, b1)
        tl.store(fp8_ptr + offs * 4 + 2, b2)
        tl.store(fp8_ptr + offs * 4 + 3, b3)

    from dgpp.quant.codecs import e2m1_unpack

    base = torch.arange(256, dtype=torch.int64)
    # word i holds byte values (i, i + 85, i + 170, 255 - i): every value appears in every position
    words = base | ((base + 85) % 256) << 8 | ((base + 170) % 256) << 16 | (255 - base) << 24
    words = words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32).cuda()
    fp4, fp8 = torch.empty(256 * 8, device="cuda"), torch.empty(256 * 4, device="cuda")
    probe[(1,)](words, fp4, fp8)
    as_bytes = words.cpu().view(torch.uint8)
    want4 = e2m1_unpack(as_bytes).float()
    want8 = as_bytes.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(want8)
    ok4 = torch.equal(fp4.cpu().view(torch.int32), want4.view(torch.int32))
    ok8 = torch.equal(fp8.cpu()[finite].view(torch.int32), want8[finite].view(torch.int32))
    for label, ok in (("E2M1 x 8 per word -> fp32", ok4), ("E4M3 x 4 per word -> fp32", ok8)):
        results["checks"].append({"check": label, "ok": ok})
        print(
            f"check {label}, every byte in every position bit-exact: {ok} {'ok' if ok else 'FAIL'}",
            flush=True,
        )


def check(name, fmt, pname, kind, sets, shapes, results) -> None:
    from dgpp.quant.kernels.row_launch import default_row_tile

    k = shapes[0][1]
    tile = default_row_tile(fmt, sum(s[0] for s in shapes), k)
    x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    got16 = run(fmt, kind, sets, shapes, x16, tile)
    for m in (1, 3, 16):
        got = run(fmt, kind, sets, shapes, x16[:m], tile).float()
        ref = reference(fmt, kind, sets, shapes, x16[:m])
        rel = ((got - ref).norm() / ref.norm()).item()
        ok = math.isfinite(rel) and rel < (2e-2 if kind == "gate_up" else 1e-2)
        results["checks"].append({"format": name, "problem": pname, "m": m, "rel_err": rel, "ok": ok})
        print(f"check {name:11s} {pname:8s} m={m:2d} rel_err={rel:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    # each row alone, and in windows of 2 and 5 rows, gives the bits it has among 16
    same = all(
        torch.equal(run(fmt, kind, sets, shapes, x16[r : r + 1], tile)[0], got16[r]) for r in range(16)
    )
    same = same and all(
        torch.equal(run(fmt, kind, sets, shapes, x16[r : r + w], tile), got16[r : r + w])
        for w in (2, 5)
        for r in range(0, 16 - w, 3)
    )
    results["checks"].append({"format": name, "problem": pname, "rows_independent": same, "ok": same})
    print(
        f"check {name:11s} {pname:8s} every row's bits independent of the rows beside it: {same} "
        f"{'ok' if same else 'FAIL'}",
        flush=True,
    )


def row_sweep(fmt) -> list:
    """Row tiles besides the default: 16-byte loads, per-weight scaling, and neighbouring shapes."""
    from dgpp.quant.kernels.row_launch import default_row_tile

    base = default_row_tile(fmt, 4096, 4096)
    return [
        dataclasses.replace(base, wide=True),
        dataclasses.replace(base, scale_weights=True),
        dataclasses.replace(base, bn=base.bn // 2),
        dataclasses.replace(base, bn=base.bn // 2, bk=2 * base.bk),
        dataclasses.replace(base, bn=2 * base.bn),
    ]


SWEEP_PROBLEMS = ("o", "gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp8_block,fp8_channel,nvfp4,nvfp4_ct,mxfp4")
    ap.add_argument("--sweep", default="nvfp4,fp8_block", help="formats whose row tiles are swept at m = 1")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import triton

    from dgpp.quant.kernels import default_tile
    from dgpp.quant.kernels.row_launch import default_row_tile

    fmts = {k: v for k, v in formats().items() if k in args.formats.split(",")}
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {
        "device": torch.cuda.get_device_name(),
        "triton": triton.__version__,
        "checks": [],
        "timings": [],
    }
    check_decoder(results)
    for name, fmt in fmts.items():
        for pname, (kind, shapes) in PROBLEMS.items():
            check(
                name, fmt, pname, kind, [random_weight(fmt, s, "cuda", gen) for s in shapes], shapes, results
            )

    copy_bw = copy_bandwidth("cuda")
    results["copy_GBps"] = copy_bw / 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    for name, fmt in fmts.items():
        layer = {}
        for pname, (kind, shapes) in PROBLEMS.items():
            one = [random_weight(fmt, s, "cuda", gen) for s in shapes]
            b = nbytes(one)
            copies = max(4, min(16, math.ceil((512 << 20) / b)))
            sets = [one] + [[random_weight(fmt, s, "cuda", gen) for s in shapes] for _ in range(copies - 1)]
            rows, per = (sum(s[0] for s in shapes), 1) if kind == "multi" else (2 * shapes[0][0], 2)
            mma = default_tile(fmt, rows, shapes[0][1], sms, per)
            row = default_row_tile(fmt, rows, shapes[0][1])
            variants = [("mma", mma, 1), ("row", row, 1)]
            if name in args.sweep.split(",") and pname in SWEEP_PROBLEMS:
                variants += [("row*", t, 1) for t in row_sweep(fmt) if t != row]
            variants += [(kname, t, m) for m in (2, 4, 16) for kname, t in (("mma", mma), ("row", row))]
            for kname, tile, m in variants:
                x = torch.randn(m, shapes[0][1], device="cuda", dtype=torch.bfloat16)
                try:
                    got = run(fmt, kind, one, shapes, x, tile).float()
                    sec = timed(functools.partial(run_copy, fmt, kind, sets, shapes, x, tile), copies)
                except Exception as e:  # a tile that does not compile or fit is reported, not fatal
                    print(f"skip {name} {pname} {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                ref = reference(fmt, kind, one, shapes, x)
                rel = ((got - ref).norm() / ref.norm()).item()
                if not rel < 2e-2:
                    print(f"WRONG {name} {pname} {kname} rel_err={rel:.2e} {tile}", flush=True)
                    results["checks"].append(
                        {"format": name, "problem": pname, "tile": str(tile), "ok": False}
                    )
                    continue
                rec = {
                    "format": name,
                    "problem": pname,
                    "kernel": kname,
                    "m": m,
                    "tile": dataclasses.asdict(tile),
                    "us": sec * 1e6,
                    "bytes": b,
                    "pct_copy": 100 * b / sec / copy_bw,
                }
                results["timings"].append(rec)
                key = (kname.rstrip("*"), m)
                layer.setdefault(key, {})
                best = layer[key].get(pname)
                layer[key][pname] = min(best, sec) if best else sec
                print(
                    f"gemv {kname:4s} m={m:2d} {name:11s} {pname:8s} {b / 1e6:7.2f}MB {sec * 1e6:7.1f}us "
                    f"{rec['pct_copy']:5.1f}% {dataclasses.asdict(tile)}",
                    flush=True,
                )
            layer.setdefault(("bytes", 0), {})[pname] = b
        total_bytes = sum(layer[("bytes", 0)].values())
        for (kname, m), per in sorted(layer.items()):
            if kname == "bytes" or len(per) != len(PROBLEMS):
                continue
            us = sum(per.values()) * 1e6
            line = {
                "format": name,
                "kernel": kname,
                "m": m,
                "layer_us": us,
                "step_ms": us * LAYERS_8B / 1e3,
                "pct_copy": 100 * total_bytes / (us * 1e-6) / copy_bw,
            }
            results.setdefault("layers", []).append(line)
            print(
                f"layer {name:11s} {kname:4s} m={m:2d} (best tile per problem) {us:7.1f}us "
                f"-> {line['step_ms']:.2f} ms/step over {LAYERS_8B} layers, {line['pct_copy']:.1f}% of copy bw",
                flush=True,
            )
    with open(os.path.join(args.out, "row_gemv.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    failed = [c for c in results["checks"] if not c["ok"]]
    print(f"checks: {len(results['checks']) - len(failed)} ok, {len(failed)} failed", flush=True)


if __name__ == "__main__":
    main()
