"""Int32-word packed linears (int4/int8 group 64, NF4I8, GPTQ int4) at serving batch sizes on a GPU. Not a test.

1. Row exactness at real sizes (bf16): every sampled row of calls of 2..300 rows through the row-exact GEMM
   (``dgpp.quant.kernels.int_rows``) equal to the row computed alone.
2. Error of a 64-row call against the decode-then-multiply reference (fp32 products of the decoded weights).
3. Time per call at each row count of ``int_rows`` and of the weight-only GEMM it replaces for canonical rows
   (``wo_matmul`` with its default tiles for that row count), over rotated weight copies (out of L2), with the
   share of the copy bandwidth for the bytes a call must read. The calls are replayed from a CUDA graph, as a
   model's decode step runs them (``--eager-launch``: launched one by one from Python, host cost included).

    PYTHONPATH=dgpp-core/src python3 tests/perf/bench_int_rows.py [--shapes 6144x6144,24576x6144] [--rows 1,16,64]
        [--tiles 64x128x4x2,128x128x4x3]   # int_rows tiles to time besides the default: BNxBKxWARPSxSTAGES[xX[xD]]
                                           # X: row blocks from which x is read in step order (0: never)
                                           # D: 1 for one dot over a program's row blocks (``one_dot``)

Each extra tile runs as it says (no device probe: ``one_dot`` is one dot even where the probe would refuse it), and its
rows are checked bit for bit against the default tile's rows alone (the same K split).
"""
# ruff: noqa: B023  (timing lambdas run inside the loop iteration that defines them)

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

COPIES = 4
EXACT_ROWS = (2, 16, 17, 64, 65, 300)
SAMPLED = (0, 1, 15, 16, 17, 63, 64, 65, 130, 299)


def formats() -> dict:
    from dgpp.quant.codebook import NF4Codebook
    from dgpp.quant.intq import GPTQ, IntPacked

    return {
        "int4_g64": IntPacked(bits=4, group=64),
        "int8_g64": IntPacked(bits=8, group=64),
        "nf4i8": NF4Codebook(),
        "gptq_int4": GPTQ(bits=4, group=128),
    }


def random_weight(fmt, shape, gen) -> dict[str, torch.Tensor]:
    from dgpp.quant.codebook import NF4Codebook
    from dgpp.quant.codecs import pack_int32
    from dgpp.quant.encode import encode

    n, k = shape
    if isinstance(fmt, NF4Codebook):
        index = torch.randint(0, 16, (n, k), generator=gen, device="cuda")
        scale = (torch.rand(n, k // fmt.group, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
        return {"weight_indices": pack_int32(index, 4, dim=1), "weight_scale": scale}
    dense = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    return fmt.prepare(encode(fmt, dense), shape)


def main() -> int:
    from triton.testing import do_bench, do_bench_cudagraph

    from dgpp.quant.kernels import default_config, quant_matmul
    from dgpp.quant.kernels.int_rows_launch import IntRowsTile, default_int_rows_tile, int_rows_linear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(formats()))
    ap.add_argument("--shapes", default="6144x6144,24576x6144")
    ap.add_argument("--rows", default="1,8,16,64,128,256")
    ap.add_argument(
        "--tiles",
        default="",
        help="extra int_rows tiles BNxBKxWARPSxSTAGES[xX[xD]] (K split as the default; X: x in step order from X row "
        "blocks; D: 1 for one dot over the row blocks)",
    )
    ap.add_argument(
        "--eager-launch", action="store_true", help="time Python launches instead of graph replays"
    )
    args = ap.parse_args()

    def timed(fn) -> float:
        """Median ms of ``fn``: replays of a CUDA graph of it (the decode step's view), or Python launches."""
        if args.eager_launch:
            return do_bench(fn, return_mode="median")
        fn()  # compile and probe outside the capture
        return do_bench_cudagraph(fn, return_mode="median")

    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_bw = 2 * src.numel() / (do_bench(lambda: src.clone(), return_mode="median") * 1e-3)
    failures = []
    print(
        "| format | shape | rows | int_rows us | wo_matmul us | int_rows % copy bw |\n|---|---|---|---|---|---|"
    )
    for name in args.formats.split(","):
        fmt = formats()[name]
        for spec in args.shapes.split(","):
            shape = tuple(int(v) for v in spec.split("x"))
            copies = [random_weight(fmt, shape, gen) for _ in range(COPIES)]
            weight_bytes = sum(t.numel() * t.element_size() for t in copies[0].values())
            x = torch.randn(300, shape[1], generator=gen, device="cuda").to(torch.bfloat16)
            alone = {i: int_rows_linear(fmt, copies[0], x[i : i + 1], shape)[0] for i in SAMPLED}
            for m in EXACT_ROWS:
                got = int_rows_linear(fmt, copies[0], x[:m], shape)
                bad = [i for i in SAMPLED if i < m and not torch.equal(got[i], alone[i])]
                if bad:
                    failures.append(f"{name} {spec}: rows {bad} of {m} differ from the row alone")
            want = x[:64].float() @ fmt.decode(copies[0], shape, torch.bfloat16).float().t()
            err = (int_rows_linear(fmt, copies[0], x[:64], shape).float() - want).abs().max().item()
            print(f"{name} {spec}: max |err| at 64 rows {err:.3e} (bf16 output)", flush=True)
            for m in [int(r) for r in args.rows.split(",")]:
                rows = x[:m].contiguous()
                cfg = default_config(fmt, m, shape, rows.device)
                t_rows = timed(lambda: [int_rows_linear(fmt, c, rows, shape) for c in copies])
                try:  # NF4I8 has no weight-only GEMM: int_rows is its only kernel
                    t_wo = timed(lambda: [quant_matmul(fmt, c, rows, shape, cfg) for c in copies])
                except NotImplementedError:
                    t_wo = float("nan")
                us_rows, us_wo = t_rows * 1e3 / COPIES, t_wo * 1e3 / COPIES
                share = (weight_bytes + rows.numel() * 2 + m * shape[0] * 2) / (us_rows * 1e-6) / copy_bw
                print(
                    f"| {name} | {spec} | {m} | {us_rows:.1f} | {us_wo:.1f} | {100 * share:.1f} |", flush=True
                )
            for spec_tile in filter(None, args.tiles.split(",")):
                bn, bk, warps, stages, *extra = (int(v) for v in spec_tile.split("x"))
                split = default_int_rows_tile(*shape, x.device).split_k
                tile = IntRowsTile(bn=bn, bk=bk, split_k=split, warps=warps, stages=stages)
                if extra:  # row blocks from which x is read in step order (0: never)
                    tile = dataclasses.replace(tile, x_in_step_order=extra[0])
                if len(extra) > 1:
                    tile = dataclasses.replace(tile, one_dot=bool(extra[1]))
                for m in EXACT_ROWS:
                    got = int_rows_linear(fmt, copies[0], x[:m], shape, tile, probe=False)
                    bad = [i for i in SAMPLED if i < m and not torch.equal(got[i], alone[i])]
                    if bad:
                        failures.append(
                            f"{name} {spec} tile {spec_tile}: rows {bad} of {m} differ from alone"
                        )
                times = []
                for m in [int(r) for r in args.rows.split(",")]:
                    rows = x[:m].contiguous()
                    t = timed(
                        lambda: [int_rows_linear(fmt, c, rows, shape, tile, probe=False) for c in copies]
                    )
                    times.append(f"{m} rows {t * 1e3 / COPIES:.1f} us")
                print(f"  tile {spec_tile} split {split}: " + ", ".join(times), flush=True)
    print("\n".join(failures) or "row exactness: all sampled rows equal alone")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
