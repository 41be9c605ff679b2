"""Packed decode GEMVs on a GPU at 8B geometry: check every kernel against the torch decode reference on
fresh random weights, then time them (CUDA-graph replays over rotated weight copies, out of L2) and print
GB/s of packed bytes (codes + scales) and % of the copy bandwidth measured here. Not a test; one line per
result, JSON to $OUT/quant_gemv.json; results go to docs/benchmarks.md ("Quantized GEMV").

    PYTHONPATH=dgpp-core/src python3 tests/perf/bench_quant_gemv.py            # H200: ~2 minutes
    PYTHONPATH=dgpp-core/src python3 tests/perf/bench_quant_gemv.py --smoke    # CPU interpreter, checks only
    options: --sweep none|small|full (variants on o_proj and gate_up for fp8_block, nvfp4, mxfp4; default
             small, prints each winner), --formats fp8_block,nvfp4,...  (--formats fp8_block,nvfp4,mxfp4
             --problems o,gate_up: the sweep alone, ~90 s)
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
import torch.nn.functional as F

LAYERS_8B = 36
# name -> (kind, weight shapes): one attention block's q/k/v and o, the MLP's gate/up and down (Qwen3-8B)
PROBLEMS = {
    "qkv": ("multi", [(4096, 4096), (1024, 4096), (1024, 4096)]),
    "o": ("multi", [(4096, 4096)]),
    "gate_up": ("gate_up", [(12288, 4096), (12288, 4096)]),
    "down": ("multi", [(4096, 12288)]),
}
SMOKE_PROBLEMS = {
    "qkv": ("multi", [(64, 256), (32, 256), (32, 256)]),
    "gate_up": ("gate_up", [(96, 256), (96, 256)]),
    "down": ("multi", [(64, 512)]),
}


def formats() -> dict:
    from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
    from dgpp.quant.fp8 import FP8Block, FP8Channel

    return {
        "fp8_block": FP8Block(),
        "fp8_channel": FP8Channel(),
        "nvfp4": NVFP4ModelOpt(),
        "nvfp4_ct": NVFP4CompressedTensors(),
        "mxfp4": MXFP4(),
    }


def random_weight(fmt, shape, device, gen) -> dict[str, torch.Tensor]:
    """Random resident tensors of ``fmt`` (finite codes, moderate scales), as a loaded layer holds them."""

    def rand_bytes(s, lo=0, hi=256):
        return torch.randint(lo, hi, s, device=device, generator=gen, dtype=torch.int32).to(torch.uint8)

    out = {}
    for name, s in fmt.tensor_shapes(shape).items():
        if name == "weight" and fmt.name.startswith("fp8"):
            b = rand_bytes(s).to(torch.int32)
            out[name] = torch.where((b & 0x7F) == 0x7F, b & 0xF0, b).to(torch.uint8).view(torch.float8_e4m3fn)
        elif fmt.name.startswith("fp8"):
            out[name] = torch.rand(s, device=device, generator=gen) * 2e-3 + 1e-4
        elif name == fmt.data_name:
            out[name] = rand_bytes(s)
        elif name == fmt.scale_name:
            out[name] = rand_bytes(s, 120, 130) if fmt.scale_kind == "e8m0" else rand_bytes(s, 0x20, 0x50)
        else:
            out[name] = torch.full(s, 3e-3 if fmt.global_op == "mul" else 300.0, device=device)
    return fmt.prepare(out, shape)


def nbytes(tensor_sets) -> int:
    return sum(t.numel() * t.element_size() for ts in tensor_sets for t in ts.values())


def run(fmt, kind, sets, shapes, x, tile=None):
    from dgpp.quant.kernels import quant_gate_up_silu, quant_multi_linear

    if kind == "gate_up":
        return quant_gate_up_silu(fmt, sets[0], sets[1], x, shapes[0], tile)
    return torch.cat(quant_multi_linear(fmt, sets, x, shapes, tile), dim=1)


def run_copy(fmt, kind, sets, shapes, x, tile, i):
    return run(fmt, kind, sets[i], shapes, x, tile)


def generic_copy(fmt, sets, shape, x, cfg, i):
    from dgpp.quant.kernels import quant_matmul

    return quant_matmul(fmt, sets[i][0], x, shape, cfg)


def reference(fmt, kind, sets, shapes, x):
    outs = [x.float() @ fmt.decode(t, s, torch.float32).t() for t, s in zip(sets, shapes, strict=True)]
    if kind == "gate_up":  # gate and up are activations in the model dtype before the product
        return F.silu(outs[0].to(x.dtype).float()) * outs[1].to(x.dtype).float()
    return torch.cat(outs, dim=1)


def check(name, fmt, pname, kind, sets, shapes, device, dtype, results) -> None:
    """Against the reference at m = 1, 3, 16; row 0 identical alone and in 16 rows; fused q/k/v equal to
    one launch per weight."""
    from dgpp.quant.kernels import default_tile, quant_multi_linear

    k = shapes[0][1]
    x16 = torch.randn(16, k, device=device, dtype=dtype)
    got16 = run(fmt, kind, sets, shapes, x16)
    for m in (1, 3, 16):
        got = run(fmt, kind, sets, shapes, x16[:m]).float()
        ref = reference(fmt, kind, sets, shapes, x16[:m])
        rel = ((got - ref).norm() / ref.norm()).item()
        invariant = torch.equal(got16[:m].float(), got) if m < 16 else True
        # gate_up: silu(g) * u of two bf16-rounded activations, each off by up to one bf16 ulp
        ok = math.isfinite(rel) and rel < (2e-2 if kind == "gate_up" else 1e-2) and invariant
        results["checks"].append(
            {"format": name, "problem": pname, "m": m, "rel_err": rel, "invariant": invariant, "ok": ok}
        )
        print(
            f"check {name:11s} {pname:8s} m={m:2d} rel_err={rel:.2e} batch_invariant={invariant} "
            f"{'ok' if ok else 'FAIL'}",
            flush=True,
        )
    if kind == "multi" and len(sets) > 1:
        # like with like: the separate launches take the fused launch's tile. By default each launch picks
        # its K split from its own N (k/v alone split more than q/k/v together), which changes the fp32
        # summation order, so the default launches agree only to rounding.
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        )
        tile = default_tile(fmt, sum(s[0] for s in shapes), k, sms)
        fused = quant_multi_linear(fmt, sets, x16, shapes, tile)
        alone = [quant_multi_linear(fmt, [t], x16, [s], tile)[0] for t, s in zip(sets, shapes, strict=True)]
        same = all(torch.equal(a, b) for a, b in zip(fused, alone, strict=True))
        results["checks"].append(
            {"format": name, "problem": pname, "fused_equals_separate": same, "ok": same}
        )
        print(
            f"check {name:11s} {pname:8s} fused == separate launches: {same} {'ok' if same else 'FAIL'}",
            flush=True,
        )


def check_generic(device, dtype, results, smoke: bool) -> None:
    """The generic weight-only kernel (prefill rows, int formats, GPTQ) still matches the reference."""
    from dgpp.quant.encode import encode
    from dgpp.quant.intq import GPTQ, IntPacked
    from dgpp.quant.kernels import quant_matmul

    n, k = (48, 256) if smoke else (1024, 4096)
    for fmt in [
        *formats().values(),
        IntPacked(bits=4, group=64),
        IntPacked(bits=8, group=64),
        GPTQ(bits=4, group=128),
        GPTQ(bits=8, group=128),
    ]:
        t = {
            key: v.to(device) for key, v in fmt.prepare(encode(fmt, torch.randn(n, k) * 0.05), (n, k)).items()
        }
        dense = fmt.decode(t, (n, k), torch.float32)
        for m in (1, 20) if smoke else (1, 64):
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = x.float() @ dense.t()
            rel = ((quant_matmul(fmt, t, x, (n, k)).float() - ref).norm() / ref.norm()).item()
            ok = math.isfinite(rel) and rel < 1e-2
            results["checks"].append(
                {"format": fmt.name, "problem": "generic", "m": m, "rel_err": rel, "ok": ok}
            )
            print(
                f"check {fmt.name:14s} quant_matmul {n}x{k} m={m:2d} rel_err={rel:.2e} {'ok' if ok else 'FAIL'}",
                flush=True,
            )


def _decode_probe(codes_ptr, fp8_ptr, lo_ptr, hi_ptr, DTYPE: tl.constexpr):  # noqa: F821 (bound at run time)
    """Every code of ``codes_ptr`` (256 bytes) through the E4M3 and the E2M1-pair PTX decoders."""
    offs = tl.arange(0, 256)  # noqa: F821
    codes = tl.load(codes_ptr + offs)  # noqa: F821
    tl.store(fp8_ptr + offs, e4m3_values(codes, DTYPE))  # noqa: F821
    lo, hi = e2m1_pairs(codes, DTYPE)  # noqa: F821
    tl.store(lo_ptr + offs, lo)  # noqa: F821
    tl.store(hi_ptr + offs, hi)  # noqa: F821


def check_decoders(device, results) -> None:
    """The inline-PTX decoders on every code, bit for bit against torch's decode (bf16 and fp16)."""
    import triton
    import triton.language as tl

    from dgpp.quant.codecs import e2m1_unpack
    from dgpp.quant.kernels.e2m1_asm import e2m1_pairs
    from dgpp.quant.kernels.e4m3_asm import e4m3_values

    globals().update(tl=tl, e2m1_pairs=e2m1_pairs, e4m3_values=e4m3_values)  # names the probe kernel resolves

    probe = triton.jit(_decode_probe)

    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    finite = (codes.to(torch.int32) & 0x7F) != 0x7F
    for dtype, tl_dtype in ((torch.bfloat16, tl.bfloat16), (torch.float16, tl.float16)):
        fp8, lo, hi = (torch.empty(256, dtype=dtype, device=device) for _ in range(3))
        probe[(1,)](codes, fp8, lo, hi, DTYPE=tl_dtype)
        want8 = codes.view(torch.float8_e4m3fn).to(dtype)
        same8 = torch.equal(fp8[finite].view(torch.int16), want8[finite].view(torch.int16))
        pairs = e2m1_unpack(codes.cpu()).to(dtype)
        same4 = torch.equal(lo.cpu().view(torch.int16), pairs[0::2].view(torch.int16)) and torch.equal(
            hi.cpu().view(torch.int16), pairs[1::2].view(torch.int16)
        )
        for name, ok in (("e4m3 bit decode", same8), ("e2m1 pair decode", same4)):
            results["checks"].append({"format": name, "problem": str(dtype), "ok": ok})
            print(f"check {name} {dtype} all codes bit-exact: {ok} {'ok' if ok else 'FAIL'}", flush=True)


SWEPT = ("fp8_block", "nvfp4", "mxfp4")  # the variant sweep runs on these, at o_proj and gate/up only
SWEPT_PROBLEMS = ("o", "gate_up")


def sweep_tiles(name: str, level: str) -> list:
    """Variants besides the default tile (each timed with its own K split): FP8 with Triton's conversion
    vs the integer bit decode, wider tiles, weights as the A operand; FP4 flat layout at three widths and
    with 8 warps (BK 512 spills on sm_90), per-byte scales, weights as A, and the first round's best tile. ``full`` adds stage
    and warp variants of each."""
    from dgpp.quant.kernels import GemvTile

    if level == "none" or name not in SWEPT:
        return []
    if name.startswith("fp8"):
        base = GemvTile(bn=32, bk=256, stages=4, warps=4, w_as_a=False, fp8_bits=True)
        tiles = [
            dataclasses.replace(base, fp8_bits=False),
            dataclasses.replace(base, bn=64, warps=8),
            dataclasses.replace(base, bk=512, stages=3),
            dataclasses.replace(base, bn=64, w_as_a=True),
        ]
    else:
        base = GemvTile(
            bn=64, bk=256, stages=4, warps=4, w_as_a=False, fp4_layout="flat", fp4_scales="broadcast"
        )
        tiles = [
            dataclasses.replace(base, bn=32),
            dataclasses.replace(base, bn=128, warps=8, stages=3),
            dataclasses.replace(base, warps=8),
            dataclasses.replace(base, fp4_scales="gather"),
            dataclasses.replace(base, w_as_a=True),
            GemvTile(bn=64, bk=256, stages=4, warps=4, w_as_a=True, interleave=True),
        ]  # round 1's best
    if level == "full":
        tiles += [dataclasses.replace(t, stages=st) for t in tiles for st in (2, 3, 4, 5) if st != t.stages]
        tiles += [dataclasses.replace(t, warps=8) for t in tiles if t.warps == 4]
    return tiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", default="small", choices=("none", "small", "full"))
    ap.add_argument("--formats", default="")
    ap.add_argument("--problems", default="", help="subset of qkv,o,gate_up,down")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.bfloat16
    fmts = {k: v for k, v in formats().items() if not args.formats or k in args.formats.split(",")}
    problems = SMOKE_PROBLEMS if args.smoke else PROBLEMS
    problems = {k: v for k, v in problems.items() if not args.problems or k in args.problems.split(",")}
    gen = torch.Generator(device=device).manual_seed(0)
    results = {
        "device": "cpu-interpreter" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "checks": [],
        "timings": [],
        "model": [],
    }
    for name, fmt in fmts.items():
        for pname, (kind, shapes) in problems.items():
            sets = [random_weight(fmt, s, device, gen) for s in shapes]
            check(name, fmt, pname, kind, sets, shapes, device, dtype, results)
    check_generic(device, dtype, results, args.smoke)
    if not args.smoke:
        check_decoders(device, results)
    failed = [c for c in results["checks"] if not c["ok"]]
    if args.smoke:
        print("smoke ok" if not failed else f"smoke FAILED: {len(failed)} checks")
        sys.exit(1 if failed else 0)
    time_all(args, fmts, problems, device, dtype, gen, results)
    with open(os.path.join(args.out, "quant_gemv.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    failed = [c for c in results["checks"] if not c["ok"]]  # the timed variants add checks
    print(f"checks: {len(results['checks']) - len(failed)} ok, {len(failed)} failed", flush=True)


def copy_bandwidth(device) -> float:
    """Device-to-device copy rate of 1 GiB in bytes/s (read + write), printed."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rate = (
        2 * src.numel() / (do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median") * 1e-3)
    )
    print(f"copy bandwidth {rate / 1e9:.0f} GB/s (read + write)", flush=True)
    return rate


def timed(fn, copies) -> float:
    """Seconds per call: one CUDA graph replays ``fn(i)`` over every weight copy."""
    from triton.testing import do_bench_cudagraph

    def step():
        for i in range(copies):
            fn(i)

    step()
    return do_bench_cudagraph(step, rep=40, return_mode="median") * 1e-3 / copies


def time_all(args, fmts, problems, device, dtype, gen, results) -> None:
    from dgpp.quant.kernels import default_config, default_tile
    from dgpp.quant.kernels.decode_launch import with_split

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    copy_bw = copy_bandwidth(device)
    results["copy_GBps"] = copy_bw / 1e9

    for name, fmt in fmts.items():
        per_layer = 0.0
        layer_bytes = 0
        for pname, (kind, shapes) in problems.items():
            one = [random_weight(fmt, s, device, gen) for s in shapes]
            b = nbytes(one)
            copies = max(4, min(16, math.ceil((512 << 20) / b)))
            sets = [one] + [[random_weight(fmt, s, device, gen) for s in shapes] for _ in range(copies - 1)]
            x = torch.randn(1, shapes[0][1], device=device, dtype=dtype)
            rows, per = (sum(s[0] for s in shapes), 1) if kind == "multi" else (2 * shapes[0][0], 2)
            tiles = [default_tile(fmt, rows, shapes[0][1], sms, per)]
            if pname in SWEPT_PROBLEMS:  # the default unsplit, and each swept tile with its own K split
                tiles += [dataclasses.replace(tiles[0], split_k=1)] if tiles[0].split_k > 1 else []
                tiles += [with_split(t, rows, shapes[0][1], sms, per) for t in sweep_tiles(name, args.sweep)]
                tiles = list(dict.fromkeys(tiles))
            best = None
            ref = reference(fmt, kind, one, shapes, x)
            for tile in tiles:
                try:
                    got = run(fmt, kind, one, shapes, x, tile).float()  # same m as timed: no extra compile
                    sec = timed(functools.partial(run_copy, fmt, kind, sets, shapes, x, tile), copies)
                except Exception as e:  # a tile that does not compile or fit is reported, not fatal
                    print(f"skip {name} {pname} {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rel = ((got - ref).norm() / ref.norm()).item()
                if not rel < (2e-2 if kind == "gate_up" else 1e-2):  # a wrong variant never wins
                    print(f"WRONG {name} {pname} rel_err={rel:.2e} {tile}", flush=True)
                    results["checks"].append(
                        {"format": name, "problem": pname, "tile": str(tile), "rel_err": rel, "ok": False}
                    )
                    continue
                row = {
                    "format": name,
                    "problem": pname,
                    "tile": dataclasses.asdict(tile),
                    "us": sec * 1e6,
                    "bytes": b,
                    "GBps": b / sec / 1e9,
                    "pct_copy": 100 * b / sec / copy_bw,
                }
                results["timings"].append(row)
                tag = "default" if tile is tiles[0] else "sweep  "
                print(
                    f"gemv {tag} {name:11s} {pname:8s} {b / 1e6:7.2f}MB {sec * 1e6:7.1f}us "
                    f"{row['GBps']:6.0f}GB/s {row['pct_copy']:5.1f}% {dataclasses.asdict(tile)}",
                    flush=True,
                )
                best = row if best is None or row["us"] < best["us"] else best
            if best is None:
                continue
            if len(tiles) > 1:
                print(
                    f"winner {name:11s} {pname:8s} {best['us']:7.1f}us {best['pct_copy']:5.1f}% {best['tile']}",
                    flush=True,
                )
                results.setdefault("winners", []).append(best)
            per_layer += best["us"]
            layer_bytes += b
            if pname == "o":  # the generic weight-only kernel on the same weights, for comparison
                cfg = default_config(fmt, 1, shapes[0], device)
                sec = timed(functools.partial(generic_copy, fmt, sets, shapes[0], x, cfg), copies)
                print(
                    f"gemv old     {name:11s} {pname:8s} {b / 1e6:7.2f}MB {sec * 1e6:7.1f}us "
                    f"{b / sec / 1e9:6.0f}GB/s {100 * b / sec / copy_bw:5.1f}% (wo_matmul)",
                    flush=True,
                )
        if per_layer:
            step_ms = per_layer * LAYERS_8B / 1e3
            pct = 100 * layer_bytes / (per_layer * 1e-6) / copy_bw
            results["model"].append(
                {
                    "format": name,
                    "layer_us": per_layer,
                    "layer_bytes": layer_bytes,
                    "step_ms_36_layers": step_ms,
                    "pct_copy": pct,
                }
            )
            print(
                f"model {name:11s} 8B layer GEMVs {per_layer:7.1f}us {layer_bytes / 1e6:7.1f}MB "
                f"-> {step_ms:.2f} ms/step over {LAYERS_8B} layers, {pct:5.1f}% of copy bandwidth",
                flush=True,
            )


if __name__ == "__main__":
    main()
