"""Every Triton kernel at real sizes on the GPU: error against its torch reference on fresh random
inputs (outputs poisoned first), and median time of both (triton.testing.do_bench).

Run on a CUDA machine: ``python tests/perf/check_kernels.py [--json out.json]``. Not a CI test.
"""
# ruff: noqa: B023  (each timing lambda is called inside record(), before its loop variables move on)

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
import triton.testing

from dgpp.kernels import gated_delta as gd
from dgpp.kernels import kv_write, moe, qk_norm_rope, rmsnorm, rotary, sampling, swiglu
from dgpp.kernels import paged_attention as pa

DEV = "cuda"
BF16 = torch.bfloat16
ROWS: list[dict] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def record(name: str, err: float, tol: float, fast, slow, nbytes: float) -> None:
    t_fast = triton.testing.do_bench(fast, warmup=25, rep=100, return_mode="median")
    t_ref = triton.testing.do_bench(slow, warmup=5, rep=40, return_mode="median")
    row = {
        "kernel": name,
        "rel_err": err,
        "ok": err <= tol,
        "triton_us": t_fast * 1e3,
        "torch_us": t_ref * 1e3,
        "GB/s": nbytes / (t_fast * 1e-3) / 1e9,
    }
    ROWS.append(row)
    print(
        f"{name:44s} err {err:.2e} ({'ok' if row['ok'] else 'FAIL'})  triton {row['triton_us']:9.1f} us  "
        f"torch {row['torch_us']:9.1f} us  {row['GB/s']:7.0f} GB/s",
        flush=True,
    )


def check_rmsnorm() -> None:
    for rows in (1, 64, 8192):
        x, r = (
            torch.randn(rows, 4096, device=DEV, dtype=BF16),
            torch.randn(rows, 4096, device=DEV, dtype=BF16),
        )
        w = torch.randn(4096, device=DEV, dtype=BF16)
        out, res = rmsnorm.rms_norm_triton(x, w, 1e-6, r)
        ref_out, ref_res = rmsnorm.rms_norm_ref(x.float(), w.float(), 1e-6, r.float())
        err = max(rel_err(out, ref_out), rel_err(res, ref_res))
        record(
            f"add+rmsnorm bf16 [{rows},4096]",
            err,
            1e-2,
            lambda: rmsnorm.rms_norm_triton(x, w, 1e-6, r),
            lambda: rmsnorm.rms_norm_ref(x, w, 1e-6, r),
            4 * x.numel() * 2,
        )


def check_rotary_swiglu_kvwrite() -> None:
    for t in (1, 64, 8192):
        q = torch.randn(t, 32, 128, device=DEV, dtype=BF16)
        k = torch.randn(t, 8, 128, device=DEV, dtype=BF16)
        pos = torch.randint(0, 40000, (t,), device=DEV)
        inv = 1.0 / 1e6 ** (torch.arange(0, 128, 2, device=DEV, dtype=torch.float32) / 128)
        qo, ko = rotary.rotary_triton(q, k, pos, inv)
        qr, kr = rotary.rotary_ref(q.float(), k.float(), pos, inv)
        record(
            f"rotary bf16 T={t} 32/8x128",
            max(rel_err(qo, qr), rel_err(ko, kr)),
            1e-2,
            lambda: rotary.rotary_triton(q, k, pos, inv),
            lambda: rotary.rotary_ref(q, k, pos, inv),
            2 * (q.numel() + k.numel()) * 2,
        )
        qw, kw = torch.randn(128, device=DEV, dtype=BF16), torch.randn(128, device=DEV, dtype=BF16)
        qo, ko = qk_norm_rope.qk_norm_rope_triton(q, k, qw, kw, 1e-6, 0.0, pos, inv)
        qr, kr = qk_norm_rope.qk_norm_rope_ref(
            q.float(), k.float(), qw.float(), kw.float(), 1e-6, 0.0, pos, inv
        )
        record(
            f"q/k norm+rotary bf16 T={t} 32/8x128",
            max(rel_err(qo, qr), rel_err(ko, kr)),
            1e-2,
            lambda: qk_norm_rope.qk_norm_rope_triton(q, k, qw, kw, 1e-6, 0.0, pos, inv),
            lambda: qk_norm_rope.qk_norm_rope_ref(q, k, qw, kw, 1e-6, 0.0, pos, inv),
            2 * (q.numel() + k.numel()) * 2,
        )
        gate, up = (
            torch.randn(t, 12288, device=DEV, dtype=BF16),
            torch.randn(t, 12288, device=DEV, dtype=BF16),
        )
        out = swiglu.silu_mul_pair_triton(gate, up)
        record(
            f"silu*mul bf16 [{t},12288]",
            rel_err(out, F.silu(gate.float()) * up.float()),
            1e-2,
            lambda: swiglu.silu_mul_pair_triton(gate, up),
            lambda: F.silu(gate) * up,
            3 * gate.numel() * 2,
        )
    kc = torch.randn(4096, 16, 8, 128, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    k, v = torch.randn(64, 8, 128, device=DEV, dtype=BF16), torch.randn(64, 8, 128, device=DEV, dtype=BF16)
    slots = torch.randperm(4096 * 16, device=DEV)[:64]
    slots[5] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    kv_write.write_kv_triton(kc, vc, k, v, slots)
    kv_write.write_kv_ref(kc2, vc2, k, v, slots)
    err = 0.0 if torch.equal(kc, kc2) and torch.equal(vc, vc2) else math.inf
    record(
        "kv write bf16 64 rows 8x128",
        err,
        0.0,
        lambda: kv_write.write_kv_triton(kc, vc, k, v, slots),
        lambda: kv_write.write_kv_ref(kc2, vc2, k, v, slots),
        4 * k.numel() * 2,
    )


def check_attention() -> None:
    # (batch, context, table width in tokens): the wide tables are a served graph's (max_position 40960)
    for batch, ctx, width in (
        (1, 384, 384),
        (1, 384, 40960),
        (1, 48, 40960),
        (64, 384, 384),
        (64, 384, 40960),
        (8, 32768, 32768),
        (64, 4096, 4096),
    ):
        bs, blocks, cols = 16, -(-ctx // 16), width // 16
        kc = torch.randn(batch * blocks + 3, bs, 8, 128, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        tables = torch.full((batch, cols), -1, device=DEV, dtype=torch.int32)
        tables[:, :blocks] = (
            torch.randperm(batch * blocks + 3, device=DEV)[: batch * blocks].view(batch, blocks).int()
        )
        lens = torch.randint(ctx // 2, ctx + 1, (batch,), device=DEV, dtype=torch.int32)
        lens[0] = ctx
        q = torch.randn(batch, 32, 128, device=DEV, dtype=BF16)
        out = torch.full((batch, 32, 128), float("nan"), device=DEV, dtype=BF16)
        out.copy_(pa.paged_decode_attention_triton(q, kc, vc, tables, lens, 128**-0.5))
        ref = pa.paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, lens, 128**-0.5)
        nbytes = float(lens.sum()) * 8 * 128 * 2 * 2
        record(
            f"paged decode attn bf16 B={batch} ctx<={ctx} table {width}",
            rel_err(out, ref),
            1e-2,
            lambda: pa.paged_decode_attention_triton(q, kc, vc, tables, lens, 128**-0.5),
            lambda: pa.paged_decode_attention_ref(q, kc, vc, tables, lens, 128**-0.5),
            nbytes,
        )
        if ctx <= 4096:  # short contexts are latency-bound: would more, shorter splits pay for the merge?
            for min_part in (64, 128, 256):
                out = pa.paged_decode_attention_triton(
                    q, kc, vc, tables, lens, 128**-0.5, min_partition=min_part
                )
                t = (
                    triton.testing.do_bench_cudagraph(
                        lambda: pa.paged_decode_attention_triton(
                            q, kc, vc, tables, lens, 128**-0.5, min_partition=min_part
                        ),
                        rep=50,
                        return_mode="median",
                    )
                    * 1e3
                )
                print(
                    f"  same, min partition {min_part} ({pa.plan_partition(batch, 8, width, min_part)[1]} splits): "
                    f"err {rel_err(out, ref):.2e}, {t:.1f} us (graph replay; default "
                    f"{pa.plan_partition(batch, 8, width)[1]} splits)",
                    flush=True,
                )


def check_prefill_attention() -> None:
    from dgpp.kernels import prefill_attention as pf

    for ctx, rows in ((0, 8192), (4096, 1024)):
        bs, total = 16, ctx + rows
        blocks = total // bs
        kc = torch.randn(blocks + 2, bs, 8, 128, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        tables = torch.randperm(blocks + 2, device=DEV)[:blocks].view(1, blocks).int()
        q = torch.randn(rows, 32, 128, device=DEV, dtype=BF16)
        starts = torch.tensor([0, rows], device=DEV, dtype=torch.int32)
        ctx_t = torch.tensor([ctx], device=DEV, dtype=torch.int32)
        out = pf.prefill_attention_triton(q, kc, vc, tables, starts, ctx_t, 128**-0.5)
        ref = pf.prefill_attention_ref(q.float(), kc.float(), vc.float(), tables, starts, ctx_t, 128**-0.5)
        flops = 4 * 32 * 128 * rows * (ctx + rows / 2)
        record(
            f"prefill attn bf16 ctx={ctx} rows={rows} 32/8x128 (GB/s column = TFLOP/s)",
            rel_err(out, ref),
            1e-2,
            lambda: pf.prefill_attention_triton(q, kc, vc, tables, starts, ctx_t, 128**-0.5),
            lambda: pf.prefill_attention_ref(q, kc, vc, tables, starts, ctx_t, 128**-0.5),
            flops / 1e3,
        )
        for tile in (
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (128, 128, 8, 2),
            (64, 128, 4, 2),
        ):
            try:
                err = rel_err(
                    pf.prefill_attention_triton(q, kc, vc, tables, starts, ctx_t, 128**-0.5, tile=tile), ref
                )
                ms = triton.testing.do_bench(
                    lambda: pf.prefill_attention_triton(
                        q, kc, vc, tables, starts, ctx_t, 128**-0.5, tile=tile
                    ),
                    warmup=10,
                    rep=50,
                    return_mode="median",
                )
                print(
                    f"prefill attn sweep ctx={ctx} rows={rows} tile {tile}: {ms * 1e3:.0f} us, "
                    f"{flops / ms / 1e9:.0f} TFLOP/s, err {err:.1e}",
                    flush=True,
                )
            except Exception as e:  # a tile that does not fit in shared memory
                print(f"prefill attn sweep tile {tile}: {type(e).__name__}", flush=True)


def check_sampling() -> None:
    for batch in (1, 64):
        logits = torch.randn(batch, 151936, device=DEV) * 4
        ones, zeros = torch.ones(batch, device=DEV), torch.zeros(batch, device=DEV)
        seeds = torch.randint(0, 2**40, (batch,), device=DEV)
        for label, params in (
            ("greedy", (zeros, zeros.int(), zeros, ones)),
            ("T=0.8 top-k 50 top-p 0.9", (ones * 0.8, (ones * 50).int(), zeros, ones * 0.9)),
            ("T=1 top-p 0.95", (ones, zeros.int(), zeros, ones * 0.95)),
        ):
            tri = sampling.sample_tokens_triton(logits, *params, seeds)
            ref = sampling.sample_tokens_ref(logits, *params, seeds)
            err = float((tri != ref).float().mean())  # share of rows drawing another token
            record(
                f"sample B={batch} V=151936 {label}",
                err,
                0.02,
                lambda: sampling.sample_tokens_triton(logits, *params, seeds),
                lambda: torch.argmax(logits, -1),
                logits.numel() * 4,
            )


def check_gated_delta() -> None:
    from dgpp.nn.gated_deltanet import chunked_gated_delta_rule, gated_delta_step

    hk, hv, dk, dv = 16, 32, 128, 128  # Qwen3-Next / Qwen3.5 linear-attention geometry
    for batch in (1, 64):
        q, k = (
            torch.randn(batch, hk, dk, device=DEV, dtype=BF16),
            torch.randn(batch, hk, dk, device=DEV, dtype=BF16),
        )
        v = torch.randn(batch, hv, dv, device=DEV, dtype=BF16)
        g = -F.softplus(torch.randn(batch, hv, device=DEV))
        beta = torch.rand(batch, hv, device=DEV, dtype=BF16)
        pool = torch.randn(batch + 1, hv, dk, dv, device=DEV) * 0.1
        slots, fresh = torch.arange(batch, device=DEV), torch.zeros(batch, dtype=torch.bool, device=DEV)
        starts = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        ref_pool = pool.clone()
        ref = gd.gated_delta_ref(q, k, v, g, beta, ref_pool, slots, starts, fresh)
        work = pool.clone()
        out = gd.gdn_decode_step_triton(q, k, v, g, beta, work, slots, fresh)
        record(
            f"gdn decode step B={batch} 16/32x128",
            max(rel_err(out, ref), rel_err(work, ref_pool)),
            1e-4,
            lambda: gd.gdn_decode_step_triton(q, k, v, g, beta, work, slots, fresh),
            lambda: gated_delta_step(q, k, v, g, beta, pool[:batch]),
            2 * pool[:batch].numel() * 4,
        )
    for length in (512, 8192):
        q, k = (
            torch.randn(length, hk, dk, device=DEV, dtype=BF16),
            torch.randn(length, hk, dk, device=DEV, dtype=BF16),
        )
        v = torch.randn(length, hv, dv, device=DEV, dtype=BF16)
        g = -F.softplus(torch.randn(length, hv, device=DEV)) * 0.2
        beta = torch.rand(length, hv, device=DEV, dtype=BF16)
        state = torch.randn(1, hv, dk, dv, device=DEV) * 0.1
        ref, ref_state = chunked_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state)
        pool = state.clone()
        one = (
            torch.zeros(1, dtype=torch.long, device=DEV),
            torch.tensor([0, length], device=DEV, dtype=torch.int32),
            torch.zeros(1, dtype=torch.bool, device=DEV),
        )
        out = gd.gdn_chunked_prefill_triton(q, k, v, g, beta, pool, *one)
        err = max(rel_err(out, ref[0]), rel_err(pool[0], ref_state[0]))
        record(
            f"gdn chunked prefill L={length} 16/32x128",
            err,
            1e-3,
            lambda: gd.gdn_chunked_prefill_triton(q, k, v, g, beta, state.clone(), *one),
            lambda: chunked_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state),
            length * (2 * hk * dk + hv * dv) * 2,
        )


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
            row = {
                "kernel": f"gemv M={m} [{n},{k}]",
                "rel_err": err,
                "ok": err <= 1e-2,
                "triton_us": t_tri,
                "torch_us": t_ref,
                "GB/s": n * k * 2 / (t_tri * 1e-6) / 1e9,
            }
            ROWS.append(row)
            print(
                f"{row['kernel']:44s} err {err:.2e} ({'ok' if row['ok'] else 'FAIL'})  triton {t_tri:9.1f} us  "
                f"cuBLAS {t_ref:9.1f} us  {row['GB/s']:7.0f} GB/s (graph replays, weights rotated)",
                flush=True,
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
        row = {
            "kernel": f"gate+up+silu M={m} 2x[12288,4096]",
            "rel_err": err,
            "ok": err <= 1e-2,
            "triton_us": t_tri,
            "torch_us": t_ref,
            "GB/s": 2 * 12288 * 4096 * 2 / (t_tri * 1e-6) / 1e9,
        }
        ROWS.append(row)
        print(
            f"{row['kernel']:44s} err {err:.2e} ({'ok' if row['ok'] else 'FAIL'})  triton {t_tri:9.1f} us  "
            f"2 cuBLAS {t_ref:9.1f} us  {row['GB/s']:7.0f} GB/s",
            flush=True,
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


def check_moe() -> None:
    experts, top_k, hidden, inter = 128, 8, 2048, 768  # Qwen3-30B-A3B geometry
    gate_up = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device=DEV, dtype=BF16) * inter**-0.5
    for tokens in (1, 64, 2048):
        x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
        w, ids = torch.randn(tokens, experts, device=DEV).softmax(-1).topk(top_k, -1)
        out = moe.fused_moe_triton(x, gate_up, down, w, ids)
        ref = moe.fused_moe_ref(x.float(), gate_up.float(), down.float(), w, ids)
        used = int(torch.unique(ids).numel())
        record(
            f"fused moe T={tokens} E=128 k=8 2048/768",
            rel_err(out, ref),
            2e-2,
            lambda: moe.fused_moe_triton(x, gate_up, down, w, ids),
            lambda: moe.fused_moe_ref(x, gate_up, down, w, ids),
            used * 3 * inter * hidden * 2,
        )
    # Qwen3.5-122B-A10B experts (hidden 3072, 1024, 256 experts, top 8): tile sweep from graph replays, the
    # routing rotated over 8 sets so the experts' weights come from HBM
    experts, top_k, hidden, inter = 256, 8, 3072, 1024
    gate_up = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device=DEV, dtype=BF16) * inter**-0.5
    for tokens in (1, 8, 64):
        x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
        routes = [torch.randn(tokens, experts, device=DEV).softmax(-1).topk(top_k, -1) for _ in range(8)]
        ref = moe.fused_moe_ref(x.float(), gate_up.float(), down.float(), *routes[0])
        used = sum(int(torch.unique(ids).numel()) for _, ids in routes) / len(routes)
        for tile in (None, (32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3)):
            try:
                err = rel_err(moe.fused_moe_triton(x, gate_up, down, *routes[0], tile=tile), ref)
                graph = torch.cuda.CUDAGraph()
                moe.fused_moe_triton(x, gate_up, down, *routes[0], tile=tile)
                with torch.cuda.graph(graph):
                    for w, ids in routes:
                        moe.fused_moe_triton(x, gate_up, down, w, ids, tile=tile)
                ms = triton.testing.do_bench(graph.replay, warmup=5, rep=30, return_mode="median") / len(
                    routes
                )
                print(
                    f"moe sweep 122B experts T={tokens} tile {tile or 'default'}: {ms * 1e3:.1f} us, "
                    f"{used * 3 * inter * hidden * 2 / ms / 1e6:.0f} GB/s of routed experts, err {err:.1e}",
                    flush=True,
                )
            except Exception as e:  # a tile that does not fit
                print(f"moe sweep tile {tile}: {type(e).__name__}: {e}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="")
    parser.add_argument("--only", default="", help="comma-separated check names (e.g. gemv,attention)")
    args = parser.parse_args()
    torch.manual_seed(0)
    checks = (
        check_rmsnorm,
        check_rotary_swiglu_kvwrite,
        check_attention,
        check_prefill_attention,
        check_sampling,
        check_gated_delta,
        check_gemv,
        check_moe,
    )
    if args.only:
        checks = tuple(c for c in checks if c.__name__.removeprefix("check_") in args.only.split(","))
    for check in checks:
        try:
            check()
        except Exception as e:  # keep going: one broken kernel must not hide the others' numbers
            ROWS.append({"kernel": check.__name__, "ok": False, "error": repr(e)})
            print(f"{check.__name__} FAILED: {e!r}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    bad = [r["kernel"] for r in ROWS if not r["ok"]]
    print(f"\nkernel checks: {len(ROWS) - len(bad)}/{len(ROWS)} ok" + (f"; failing: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
