"""Packed MoE experts through the fused grouped GEMM on the GPU, at a Qwen3.5-122B-A10B expert shape.

For each format and token count: error against the per-expert decode reference (bf16, and fp32 as the
exact value), time of the fused layer (CUDA-graph replays with the routing rotated over several sets, so
the routed experts' weights come from HBM, not L2), GB/s of the routed experts' packed bytes, eager
time, the old per-expert loop's time (A/B), and a CUDA-graph capture of the layer replayed with new
routing, which must equal eager bit for bit; the first tokens each alone, which must equal their rows in
the batch bit for bit; for eight codes a word, the layer with its activations read column
by column instead of in step order (time, and bits against the step-order output). One line per result. Not a
CI test.

    python3 tests/perf/check_quant_moe.py [--tokens 1,8,64] [--formats fp8,nvfp4,mxfp4,int4] [--sweep [BNxKxWARPSxSTAGES[xBM[xBLOCKS]],...]]
                                          [--no-old-loop] [--json f]

Shape (Qwen3.5-122B-A10B's experts): hidden 3072, moe_intermediate 1024, 256 experts, top 8 (flags change it).
"""
# ruff: noqa: B023  (timing lambdas run inside the loop iteration that defines them)

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "dgpp-core" / "src")]

import torch  # noqa: E402
import triton.testing  # noqa: E402

from dgpp.kernels.moe import align_to_experts  # noqa: E402
from dgpp.kernels.moe_align import align_to_experts_triton  # noqa: E402
from dgpp.policy import overriding  # noqa: E402
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt  # noqa: E402
from dgpp.quant.fp8 import FP8Block  # noqa: E402
from dgpp.quant.intq import GPTQ, IntPacked  # noqa: E402
from dgpp.quant.kernels import moe_block_probe, moe_launch  # noqa: E402
from dgpp.quant.kernels.launch import _pack  # noqa: E402
from dgpp.quant.kernels.moe_launch import MoETiles, fused_quant_moe, moe_tiles  # noqa: E402
from dgpp.quant.moe import QuantExperts  # noqa: E402

DEV = "cuda"
COPY_BW = 4.2e12  # H200 copy bandwidth measured on this code's machine (read + write)
FORMATS = {
    "fp8": FP8Block(block=(128, 128)),
    "nvfp4": NVFP4ModelOpt(),
    "nvfp4_ct": NVFP4CompressedTensors(),
    "mxfp4": MXFP4(),
    "int4": IntPacked(bits=4, group=64),
    "gptq4": GPTQ(bits=4, group=128),
}
ROWS: list[dict] = []


def fill_random(moe: QuantExperts) -> None:
    """Valid random packed tensors (no NaN codes), scales sized so each output is O(1) for unit inputs."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stack = getattr(moe, proj)
        fmt, k = stack.fmt, stack.shape[1]
        for name in stack.names:
            p = getattr(stack, name)
            if p.dtype == torch.float8_e4m3fn:  # FP8 codes, std 64
                for e in range(p.shape[0]):
                    p.data[e] = (torch.randn(p.shape[1:], device=DEV) * 64).to(torch.float8_e4m3fn)
            elif name == getattr(fmt, "global_name", None):  # carries the k^-0.5 so E4M3 scales stay normal
                g = 0.3 * k**-0.5
                p.data.fill_(g if fmt.global_op == "mul" else 1 / g)
            elif name == getattr(fmt, "scale_name", None) and p.dtype == torch.uint8:
                if fmt.scale_kind == "e8m0":  # 2^-9 .. 2^-5
                    p.data.copy_(torch.randint(118, 123, p.shape, device=DEV, dtype=torch.uint8))
                else:
                    p.data.copy_(
                        (torch.rand(p.shape, device=DEV) + 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
                    )
            elif p.dtype == torch.uint8:  # E2M1 pairs: every byte is valid
                p.data.copy_(torch.randint(0, 256, p.shape, device=DEV, dtype=torch.uint8))
            elif p.dtype == torch.int32:  # packed int codes / zeros
                p.data.copy_(torch.randint(-(2**31), 2**31 - 1, p.shape, device=DEV, dtype=torch.int32))
            else:  # float scales as shipped: FP8 block F32, compressed-tensors int BF16, GPTQ F16
                dtype = {"weight_scale": torch.bfloat16, "scales": torch.float16}.get(name, torch.float32)
                code_std = 64 if isinstance(fmt, FP8Block) else 4
                p.data = ((torch.rand(p.shape, device=DEV) + 0.5) * k**-0.5 / code_std).to(dtype)


def expert_bytes(moe: QuantExperts) -> int:
    """Resident packed bytes of one expert (gate + up + down, scales included)."""
    total = 0
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stack = getattr(moe, proj)
        total += sum(getattr(stack, n)[0].numel() * getattr(stack, n).element_size() for n in stack.names)
    return total


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def routings(tokens: int, experts: int, top_k: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(count):
        w, ids = torch.randn(tokens, experts, device=DEV).softmax(-1).topk(top_k, dim=-1)
        out.append(((w / w.sum(-1, keepdim=True)).to(torch.bfloat16), ids))
    return out


def layer(moe: QuantExperts, tiles: MoETiles | None):
    g, d = moe.gate_proj, moe.down_proj
    return lambda x, w, ids: fused_quant_moe(
        (g.fmt, g.stacks(), moe.up_proj.stacks()), (d.fmt, d.stacks()), x, w, ids, moe.inter, tiles
    )


def graph_equals_eager(fn, x: torch.Tensor, routes) -> bool:
    """Capture ``fn`` on static inputs, replay after copying each routing in: must equal eager exactly."""
    w_s, ids_s = routes[0][0].clone(), routes[0][1].clone()
    for _ in range(2):
        fn(x, w_s, ids_s)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, w_s, ids_s)
    same = True
    for w, ids in routes[:4]:
        w_s.copy_(w)
        ids_s.copy_(ids)
        graph.replay()
        same &= torch.equal(out, fn(x, w, ids))
    return bool(same)


def check(name: str, fmt, args, sweep: list | None) -> None:
    with torch.device(DEV):
        moe = QuantExperts(fmt, args.experts, args.hidden, args.inter)
    fill_random(moe)
    per_expert = expert_bytes(moe)
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device=DEV, dtype=torch.bfloat16)
        routes = routings(tokens, args.experts, args.top_k, args.rotate)
        w, ids = routes[0]
        fused = layer(moe, None)
        got = fused(x, w, ids)
        with overriding(quant_torch_only=True):  # the reference decodes each picked expert (no Triton)
            ref = moe.forward_reference(x, w, ids)
            exact = moe.forward_reference(x.float(), w.float(), ids)
        err, err32, ref_err32 = rel_err(got, ref), rel_err(got, exact), rel_err(ref, exact)
        graph_ok = graph_equals_eager(fused, x, routes)
        alone_ok = rows_alone_equal(fused, x, w, ids, got)
        used = sum(r[1].unique().numel() for r in routes) / len(routes)
        nbytes = used * per_expert + x.numel() * 2
        t_graph = triton.testing.do_bench_cudagraph(
            lambda: [fused(x, a, b) for a, b in routes], rep=100, return_mode="median"
        ) / len(routes)
        bm = moe_tiles(_pack(moe.fmt), ids.numel(), moe.num_experts).bm
        t_align = triton.testing.do_bench_cudagraph(
            lambda: align_to_experts(ids, moe.num_experts, bm), rep=50, return_mode="median"
        )  # the torch routing sort
        pairs = zip(
            align_to_experts(ids, moe.num_experts, bm),
            align_to_experts_triton(ids, moe.num_experts, bm),
            strict=True,
        )
        align_same = all(torch.equal(a, b) for a, b in pairs)
        t_align1 = triton.testing.do_bench_cudagraph(
            lambda: align_to_experts_triton(ids, moe.num_experts, bm), rep=50, return_mode="median"
        )  # what fused_quant_moe uses
        t_eager = triton.testing.do_bench(lambda: fused(x, w, ids), warmup=10, rep=50, return_mode="median")
        try:  # the old CUDA path: a packed linear launch per picked expert, after a host sync
            t_loop = (
                math.nan
                if args.no_old_loop
                else triton.testing.do_bench(
                    lambda: moe.forward_reference(x, w, ids), warmup=3, rep=30, return_mode="median"
                )
            )
        except (
            Exception
        ) as exc:  # that path's own kernels are checked elsewhere; a failure here is only reported
            print(f"  old loop failed: {type(exc).__name__}: {exc}", flush=True)
            t_loop = math.nan
        # bf16 rounds in different places than the reference (activation, fp32 sums): the fused result must
        # be as close to the exact fp32 value as the reference is, within 2x
        ok = err <= 2e-2 and err32 <= 2 * ref_err32 and graph_ok and align_same and alone_ok
        row = {
            "check": f"quant_moe {name}",
            "tokens": tokens,
            "experts_used": used,
            "rel_err_vs_ref": err,
            "rel_err_vs_fp32": err32,
            "ref_rel_err_vs_fp32": ref_err32,
            "graph_equals_eager": graph_ok,
            "rows_alone_equal": alone_ok,
            "ok": ok,
            "graph_us": t_graph * 1e3,
            "align_torch_us": t_align * 1e3,
            "align_triton_us": t_align1 * 1e3,
            "align_same": align_same,
            "eager_us": t_eager * 1e3,
            "old_loop_us": t_loop * 1e3,
            "GB/s": nbytes / (t_graph * 1e-3) / 1e9,
        }
        row["pct_copy_bw"] = 100 * row["GB/s"] * 1e9 / COPY_BW
        ROWS.append(row)
        print(
            f"quant_moe {name:8s} T={tokens:3d} experts {used:5.1f}  err {err:.2e} (fp32 {err32:.2e}, ref {ref_err32:.2e})"
            f"  graph==eager {graph_ok}  alone==batch (bm {bm}) {alone_ok}  {'ok' if ok else 'FAIL'}"
            f"  graph {row['graph_us']:8.1f} us "
            f"(align torch {row['align_torch_us']:5.1f} / one launch {row['align_triton_us']:5.1f}, same {align_same})  "
            f"eager {row['eager_us']:8.1f} us  old loop {row['old_loop_us']:8.1f} us  "
            f"{row['GB/s']:6.0f} GB/s ({row['pct_copy_bw']:.0f}% of copy bw)",
            flush=True,
        )
        report_block_probe(name)
        if sweep:
            sweep_tiles(name, moe, x, routes, nbytes, tokens, ref, sweep)
        if moe_launch._reads_step_order(
            moe_launch.stack_args(moe.gate_proj.fmt, moe.gate_proj.stacks(), (args.inter, args.hidden)),
            moe_launch.moe_tiles(_pack(moe.fmt), ids.numel(), moe.num_experts),
        ):
            columns_against_step_order(name, fused, x, routes, got, tokens, t_graph)


REPORTED: set = set()


def report_block_probe(name: str) -> None:
    """What ``moe_block_probe`` chose for this format's prefill-sized batches (the fastest form whose rows got the
    16-row blocks' bits, the 16-row blocks included), where a batch asked."""
    for key, chosen in moe_block_probe._CHOSEN.items():
        if key not in REPORTED:
            REPORTED.add(key)
            form = (
                "16-row blocks"
                if chosen.bm == moe_launch.DECODE_BM
                else f"64-row blocks ({chosen.row_blocks} a program)"
            )
            print(
                f"  {name}: prefill blocks chosen on this device: {form}, of the bit-identical forms the fastest"
                f" (64-row candidates: {[(t.bm, t.row_blocks) for t in key[5]]})",
                flush=True,
            )


def rows_alone_equal(fused, x, w, ids, got, count: int = 4) -> bool:
    """The first tokens each alone (one token: 16-row expert blocks) against the same tokens in this batch, bit
    for bit: a batch above 4 assignments per expert takes 64-row blocks, which Triton issues as wgmma where the
    16-row blocks issue mma, so this is where a token's bits could follow its batch."""
    return all(
        torch.equal(fused(x[i : i + 1], w[i : i + 1], ids[i : i + 1]), got[i : i + 1])
        for i in range(min(count, x.shape[0]))
    )


def sweep_tiles(name, moe, x, routes, nbytes, tokens, ref, grid) -> None:
    """Time each tile of ``grid`` (BN, K-step multiple, warps, stages[, BM]) and compare its output with the default
    tile's bit for bit: a tile changes which program computes a column, not the column's K chain."""
    base = moe_tiles(_pack(moe.fmt), routes[0][1].numel(), moe.num_experts)
    want = layer(moe, None)(x, *routes[0])
    for bn, k_steps, warps, stages, *rows in grid:
        bkp = base.bkp * k_steps
        tiles = MoETiles(
            bm=rows[0] if rows else base.bm,
            bn=bn,
            bkp=bkp,
            num_warps=warps,
            num_stages=stages,
            row_blocks=rows[1] if len(rows) > 1 else 1,
        )
        fn = layer(moe, tiles)
        try:
            out = fn(x, *routes[0])
            t = triton.testing.do_bench_cudagraph(
                lambda: [fn(x, a, b) for a, b in routes], rep=50, return_mode="median"
            ) / len(routes)
        except Exception as exc:  # e.g. out of shared memory for this tile
            print(
                f"  sweep {name} T={tokens} bn {bn} bkp {bkp} warps {warps} stages {stages}: {type(exc).__name__}"
            )
            continue
        print(
            f"  sweep {name:8s} T={tokens:3d} bm {tiles.bm}/{tiles.row_blocks} bn {bn:2d} bkp {tiles.bkp} warps {warps} "
            f"stages {stages}  err {rel_err(out, ref):.1e}  bits == default tile {torch.equal(out, want)}  "
            f"{t * 1e3:8.1f} us  {nbytes / (t * 1e-3) / 1e9:6.0f} GB/s",
            flush=True,
        )


def columns_against_step_order(name, fused, x, routes, got, tokens, t_step_order) -> None:
    """Eight codes a word: the same layer with the activations read column by column instead of in step order
    (``moe_launch._reads_step_order``): its time, and its output against the step-order one bit for bit."""
    step_order = moe_launch._reads_step_order
    moe_launch._reads_step_order = lambda args, tiles: False
    try:
        same = torch.equal(fused(x, *routes[0]), got)
        t = triton.testing.do_bench_cudagraph(
            lambda: [fused(x, a, b) for a, b in routes], rep=100, return_mode="median"
        ) / len(routes)
    finally:
        moe_launch._reads_step_order = step_order
    print(
        f"  activations {name:8s} T={tokens:3d}: step order {t_step_order * 1e3:8.1f} us, column reads "
        f"{t * 1e3:8.1f} us, bits equal {same}",
        flush=True,
    )


def tile_grid(text: str) -> list[tuple[int, ...]]:
    """``BNxKxWARPSxSTAGES[xBM[xBLOCKS]],...`` (K: multiple of the default K step; BM: rows a block, else the token
    count's; BLOCKS: row blocks a program, ``MoETiles.row_blocks``), or ``full`` for the whole grid."""
    if text == "full":
        return [
            (bn, k, w, st)
            for k, bn, (w, st) in itertools.product(
                (1, 2, 4), (16, 32, 64), ((4, 3), (2, 3), (4, 4), (8, 3), (2, 5))
            )
        ]
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--formats", default="fp8,nvfp4,mxfp4,int4", help=f"comma list of {','.join(FORMATS)}")
    ap.add_argument(
        "--rotate", type=int, default=8, help="routing sets cycled per timed replay (weights out of L2)"
    )
    ap.add_argument("--no-old-loop", action="store_true", help="skip timing the old per-expert loop (A/B)")
    ap.add_argument(
        "--sweep",
        nargs="?",
        const="full",
        help="also time tiles per format and token count: BNxKxWARPSxSTAGES[xBM[xBLOCKS]],... (K: multiple of the default K"
        " step) or full (the default grid), each compared bit for bit with the default tile",
    )
    ap.add_argument("--json", help="write the result rows here")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for name in args.formats.split(","):
        check(name, FORMATS[name], args, tile_grid(args.sweep) if args.sweep else None)
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1))
    failed = [r for r in ROWS if not r["ok"]]
    print(f"{len(ROWS) - len(failed)}/{len(ROWS)} ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
