"""Row exactness on the GPU (``dgpp.nn.exact.routing``): is a row the same bits whatever the row count, for each
linear and attention path, and what does the canonical path cost against the stock one?

    PYTHONPATH=dgpp-core/src TRITON_INTERPRET=0 python3 tests/perf/check_exact_cuda.py
    python tests/perf/check_exact_cuda.py --smoke      # CPU, interpreter, tiny shapes, no timing (~3 min)
    ... --only linears,attention,moe,packed            # a subset

One line per result. ``same`` lines compare every row of an M-row call with the same row computed alone
(M = 1) for M in ROW_COUNTS; ``time`` lines are do_bench medians with the weights rotated out of L2.
Exits non-zero when a canonical path is not row-exact (stock paths are reported, not judged).
"""

# ruff: noqa: B023
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton.testing

from dgpp.kernels import gemv, moe
from dgpp.kernels import paged_attention as pa
from dgpp.nn.exact.attention import expand_rows, paged_decode_attention_fixed
from dgpp.nn.exact.gemm import fixed_order_gate_up_silu, fixed_order_linear
from dgpp.policy import current

DEV, BF16 = "cuda", torch.bfloat16
ROW_COUNTS = (1, 2, 3, 8, 16, 17, 64, 65, 300, 512, 1000)  # 512 on: the prefill tiles (nn.exact.gemm)
ROW_BLOCKS = (64, 16)
FAILS: list[str] = []
# real sizes; --smoke shrinks them (fp32, CPU interpreter) so the script's logic is covered without a GPU
SIZES = {
    "hidden": 4096,
    "inter": 12288,
    "kv": 1024,
    "vocab": 151936,
    "experts": 128,
    "ctx": 4096,
    "heads": (32, 8, 128),
    "moe": (64, 2048, 768, 8),
    "time_rows": (1, 8, 64, 300, 4096, 8192),
    "batches": (1, 64),
}
TIMING = {"on": True}


def same_rows(name: str, fn, x: torch.Tensor, judged: bool) -> None:
    solo = torch.cat([fn(x[r : r + 1]) for r in range(x.shape[0])])
    bad = [m for m in ROW_COUNTS if not torch.equal(fn(x[:m]), solo[:m])]
    diff = max((float((fn(x[:m]).float() - solo[:m].float()).abs().max()) for m in bad), default=0.0)
    verdict = "IDENTICAL" if not bad else f"DIFFERENT at M={bad} (max abs {diff:.3e})"
    print(f"same  {name:46s} {verdict}", flush=True)
    if bad and judged:
        FAILS.append(name)


def bench(fn_of, copies: list) -> float:
    """Median us of ``fn_of(copy)``, cycling through weight copies so each call reads from HBM."""
    if not TIMING["on"]:
        return float("nan")
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(copies)
        fn_of(copies[state["i"]])

    return triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median") * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check_linears() -> None:
    h, i, kv, vocab = SIZES["hidden"], SIZES["inter"], SIZES["kv"], SIZES["vocab"]
    shapes = {
        f"qkv {h}->{h}+{kv}+{kv}": (h, [h, kv, kv]),
        f"o {h}->{h}": (h, [h]),
        f"down {i}->{h}": (i, [h]),
        f"lm head {h}->{vocab}": (h, [vocab]),
        f"router {h}->{SIZES['experts']}": (h, [SIZES["experts"]]),
    }
    for name, (k, ns) in shapes.items():
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5 for n in ns]
        x = torch.randn(max(ROW_COUNTS), k, device=DEV, dtype=BF16)

        def fixed(rows, bm=None):
            return torch.cat(fixed_order_linear(rows, ws, bm), 1)

        def stock(rows):
            return torch.cat(gemv.multi_linear(rows, ws), 1)

        for bm in ROW_BLOCKS:  # the engine's row block is judged; the other is reported for the choice
            same_rows(
                f"linear fixed BM{bm} {name}", lambda r: fixed(r, bm), x, bm == current().exact_row_block
            )
        same_rows(f"linear stock {name}", stock, x, False)
        # what the engine calls: the stock GEMV up to 64 rows, the fixed tile above; judged
        same_rows(f"linear engine {name}", fixed, x, True)
        print(
            f"err   linear fixed {name:40s} {rel_err(fixed(x), torch.cat([F.linear(x.float(), w.float()) for w in ws], 1)):.2e}"
        )
        nbytes = sum(w.numel() for w in ws) * 2
        copies = [[w.clone() for w in ws] for _ in range(max(2, int(2e8 // nbytes) + 1))]
        for m in [r for r in SIZES["time_rows"] if r <= 300 or "head" not in name]:
            xm = torch.randn(m, k, device=DEV, dtype=BF16)
            t_stock = bench(lambda c: gemv.multi_linear(xm, c), copies)
            line = " ".join(
                f"BM{bm} {bench(lambda c: fixed_order_linear(xm, c, bm), copies):9.1f} us"
                for bm in ROW_BLOCKS
            )
            t_engine = bench(lambda c: fixed_order_linear(xm, c), copies)
            print(
                f"time  linear {name:30s} M={m:5d} fixed {line} engine {t_engine:9.1f} us  stock {t_stock:9.1f} us",
                flush=True,
            )
    wg, wu = (torch.randn(i, h, device=DEV, dtype=BF16) / h**0.5 for _ in range(2))
    x = torch.randn(max(ROW_COUNTS), h, device=DEV, dtype=BF16)
    for bm in ROW_BLOCKS:
        same_rows(
            f"gate_up_silu fixed BM{bm} {h}->2x{i}",
            lambda r: fixed_order_gate_up_silu(r, wg, wu, bm),
            x,
            bm == current().exact_row_block,
        )
    same_rows(f"gate_up_silu stock {h}->2x{i}", lambda r: gemv.gate_up_silu(r, wg, wu), x, False)
    same_rows(f"gate_up_silu engine {h}->2x{i}", lambda r: fixed_order_gate_up_silu(r, wg, wu), x, True)
    copies = [(wg.clone(), wu.clone()) for _ in range(2)]
    for m in SIZES["time_rows"]:
        xm = torch.randn(m, h, device=DEV, dtype=BF16)
        t_stock = bench(lambda c: gemv.gate_up_silu(xm, *c), copies)
        line = " ".join(
            f"BM{bm} {bench(lambda c: fixed_order_gate_up_silu(xm, *c, bm), copies):9.1f} us"
            for bm in ROW_BLOCKS
        )
        t_engine = bench(lambda c: fixed_order_gate_up_silu(xm, *c), copies)
        print(
            f"time  gate_up_silu {h}->2x{i:<23d} M={m:5d} fixed {line} engine {t_engine:9.1f} us  stock {t_stock:9.1f} us",
            flush=True,
        )


def check_attention() -> None:
    (hq, hk, d), ctx, bs = SIZES["heads"], SIZES["ctx"], 16
    blocks = 64 * (ctx // bs) + 8
    kc = torch.randn(blocks, bs, hk, d, device=DEV, dtype=BF16)
    vc = torch.randn(blocks, bs, hk, d, device=DEV, dtype=BF16)
    perm = torch.randperm(blocks, device=DEV)[: 64 * (ctx // bs)].view(64, ctx // bs).int()
    lens = torch.randint(1, ctx + 1, (64,), device=DEV, dtype=torch.int32)
    lens[0], lens[1] = 37, ctx  # one short (direct) row, one full-table row
    q = torch.randn(64, hq, d, device=DEV, dtype=BF16)
    for label, fn, judged in (
        ("fixed", paged_decode_attention_fixed, True),
        ("stock", pa.paged_decode_attention, False),
    ):
        solo = torch.cat(
            [fn(q[r : r + 1], kc, vc, perm[r : r + 1], lens[r : r + 1], d**-0.5) for r in range(64)]
        )
        bad = [
            m
            for m in (1, 2, 3, 8, 16, 17, 64)
            if not torch.equal(fn(q[:m], kc, vc, perm[:m], lens[:m], d**-0.5), solo[:m])
        ]
        wide = torch.cat(
            [perm, perm[:, :64]], 1
        )  # a wider table (a served graph's) must not change a row either
        bad += ["wide"] if not torch.equal(fn(q, kc, vc, wide, lens, d**-0.5), solo) else []
        print(
            f"same  decode attention {label} (batch / table width)    {'IDENTICAL' if not bad else f'DIFFERENT at {bad}'}"
        )
        if bad and judged:
            FAILS.append(f"decode attention {label}")
    ref = pa.paged_decode_attention_ref(q[:8], kc, vc, perm[:8], lens[:8], d**-0.5)
    print(
        f"err   decode attention fixed                   {rel_err(paged_decode_attention_fixed(q[:8], kc, vc, perm[:8], lens[:8], d**-0.5), ref):.2e}"
    )
    # a verify: 4 rows of one sequence == the four decode rows of those positions
    end = ctx // 4 + 4
    _, tables, vlens = expand_rows(perm[:1], [end], [4])
    rows = paged_decode_attention_fixed(q[:4], kc, vc, tables, vlens, d**-0.5)
    alone = torch.cat(
        [
            paged_decode_attention_fixed(
                q[j : j + 1],
                kc,
                vc,
                perm[:1],
                torch.tensor([end - 3 + j], device=DEV, dtype=torch.int32),
                d**-0.5,
            )
            for j in range(4)
        ]
    )
    print(
        f"same  verify rows == decode rows                   {'IDENTICAL' if torch.equal(rows, alone) else 'DIFFERENT'}"
    )
    if not torch.equal(rows, alone):
        FAILS.append("verify rows")
    for b in SIZES["batches"]:
        full = torch.full((b,), ctx, device=DEV, dtype=torch.int32)
        t_fixed = bench(lambda _: paged_decode_attention_fixed(q[:b], kc, vc, perm[:b], full, 0.1), [None])
        t_stock = bench(lambda _: pa.paged_decode_attention(q[:b], kc, vc, perm[:b], full, 0.1), [None])
        print(
            f"time  decode attention batch {b:2d} ctx {ctx}          fixed {t_fixed:9.1f} us  stock {t_stock:9.1f} us  "
            f"cost {100 * (t_fixed / t_stock - 1):+6.1f}%",
            flush=True,
        )


def check_moe() -> None:
    e, h, inter, top = SIZES["moe"]
    gate_up = torch.randn(e, 2 * inter, h, device=DEV, dtype=BF16) / h**0.5
    down = torch.randn(e, h, inter, device=DEV, dtype=BF16) / inter**0.5
    x = torch.randn(max(ROW_COUNTS), h, device=DEV, dtype=BF16)
    ids = torch.stack([torch.randperm(e, device=DEV)[:top] for _ in range(x.shape[0])])
    w = torch.rand(x.shape[0], top, device=DEV).to(BF16)

    def fn(r):
        return moe.fused_moe_triton(r, gate_up, down, w[_rows(r, x)], ids[_rows(r, x)])

    same_rows(f"fused moe {e} experts top {top} ({h}/{inter})", fn, x, True)


def check_packed() -> None:
    """Canonical rows of packed (FP8 / NVFP4) linears: the decode GEMV in launches of <= 16 rows, for each of
    the two kernels an engine can fix (``engine.quant_decode_gemv``), against the weight-only GEMM."""

    from bench_quant_gemv import formats, random_weight

    from dgpp.policy import overriding
    from dgpp.quant.linear import decode_rows, packed_matmul

    h, kv, i = SIZES["hidden"], SIZES["kv"], SIZES["inter"]
    gen = torch.Generator(device=DEV).manual_seed(0)
    for fname in ("nvfp4", "fp8_block"):
        fmt = formats()[fname]
        for name, shapes in (
            (f"qkv {h}->{h}+{kv}+{kv}", [(h, h), (kv, h), (kv, h)]),
            (f"down {i}->{h}", [(h, i)]),
        ):
            sets = [random_weight(fmt, s, DEV, gen) for s in shapes]
            x = torch.randn(max(ROW_COUNTS), shapes[0][1], device=DEV, dtype=BF16)
            for kernel in ("row", "mma"):
                with overriding(quant_decode_gemv=kernel):
                    same_rows(
                        f"packed {fname} {kernel} {name}",
                        lambda r: torch.cat(decode_rows(fmt, sets, r, shapes), 1),
                        x,
                        True,
                    )
                    for m in SIZES["time_rows"][:3]:
                        t = bench(lambda c: decode_rows(fmt, c, x[:m], shapes), [sets])
                        gemm = bench(
                            lambda c: [
                                packed_matmul(fmt, w, x[:m], s) for w, s in zip(c, shapes, strict=True)
                            ],
                            [sets],
                        )
                        print(
                            f"time  packed {fname} {kernel} {name:24s} M={m:5d} decode rows {t:9.1f} us  "
                            f"weight-only GEMM {gemm:9.1f} us (weights L2-warm)",
                            flush=True,
                        )


def _rows(r: torch.Tensor, x: torch.Tensor) -> slice:
    start = (r.data_ptr() - x.data_ptr()) // (x.stride(0) * x.element_size())
    return slice(start, start + r.shape[0])


def smoke() -> None:
    """Tiny fp32 shapes on the CPU under the Triton interpreter, no timing: the script's own logic."""
    global DEV, BF16, ROW_COUNTS
    DEV, BF16, ROW_COUNTS = "cpu", torch.float32, (1, 2, 17, 65)
    TIMING["on"] = False
    SIZES.update(
        hidden=64,
        inter=96,
        kv=32,
        vocab=512,
        experts=16,
        ctx=192,
        heads=(4, 2, 32),
        moe=(8, 64, 32, 2),
        time_rows=(1, 65),
        batches=(1, 4),
    )


if __name__ == "__main__":
    if "--smoke" in sys.argv:
        smoke()
    torch.manual_seed(0)
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    for part, check in (
        ("linears", check_linears),
        ("attention", check_attention),
        ("moe", check_moe),
        ("packed", check_packed),
    ):
        if only is None or part in only:
            check()
    print("FAILED: " + ", ".join(FAILS) if FAILS else "all canonical paths row-exact")
    sys.exit(1 if FAILS else 0)
