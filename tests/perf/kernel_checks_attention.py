"""Attention kernels at real sizes on the GPU: paged decode (with its split sweep), prefill (with its tile sweep), the
sink full layers' split-context decode, and paged decode over e4m3 K/V rows."""

# ruff: noqa: B023  (each timing lambda runs before its loop variables move on)

from __future__ import annotations

import torch
import triton.testing
from kernel_checks_record import BF16, DEV, record, record_times, rel_err

from dgpp.kernels import paged_attention as pa


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


# MiMo-V2.6-Flash's full-attention layer: 64 query heads over 4 KV heads, q/k 192 wide, v 128, a sink per head
SINK_CASES = ((1, 1024), (1, 8192), (1, 32768), (8, 32768))


def check_sink_decode_attention(cases=SINK_CASES, device: str = DEV) -> None:
    """Decode rows of a sink full layer: the split-context kernel (32 fixed splits, as the engine runs it) against
    the fp32 reference, timed against the window kernel's one program per (row, KV head) (the "ref" column)."""
    from dgpp.kernels import window_attention as wa
    from dgpp.nn.exact.attention import paged_decode_attention_fixed

    hq, hk, dim, v_dim, bs = 64, 4, 192, 128, 16
    for batch, ctx in cases:
        blocks = -(-ctx // bs)
        kc = torch.randn(batch * blocks + 3, bs, hk, dim, device=device, dtype=BF16)
        vc = torch.randn(batch * blocks + 3, bs, hk, v_dim, device=device, dtype=BF16)
        perm = torch.randperm(batch * blocks + 3, device=device)[: batch * blocks]
        tables = perm.view(batch, blocks).int()
        lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
        q = torch.randn(batch, hq, dim, device=device, dtype=BF16)
        sinks = torch.randn(hq, device=device, dtype=BF16) + 4.0
        starts = torch.arange(batch + 1, device=device, dtype=torch.int32)
        window_args = (q, None, None, kc, vc, tables, starts, lens - 1, lens, sinks, dim**-0.5, 0, True)

        def split(q=q, kc=kc, vc=vc, tables=tables, lens=lens, sinks=sinks):
            return paged_decode_attention_fixed(q, kc, vc, tables, lens, dim**-0.5, sinks=sinks)

        out = split()
        one = slice(0, 1)  # the fp32 reference walks rows on the host: the first row is enough
        ref = wa.window_attention_ref(
            q[one].float(),
            None,
            None,
            kc.float(),
            vc.float(),
            tables[one],
            starts[:2],
            lens[one] - 1,
            lens[one],
            sinks.float(),
            dim**-0.5,
            0,
            True,
        )
        t_split = triton.testing.do_bench_cudagraph(split, rep=50, return_mode="median") * 1e3
        t_window = (
            triton.testing.do_bench_cudagraph(
                lambda: wa.window_attention_triton(*window_args), rep=50, return_mode="median"
            )
            * 1e3
        )
        record_times(
            f"sink decode attn bf16 B={batch} ctx={ctx} 64/4x192/128",
            rel_err(out[one], ref),
            1e-2,
            t_split,
            t_window,
            float(lens.sum()) * hk * (dim + v_dim) * 2,
            ref_label="window kernel",
        )


# Qwen3-8B's attention (32 query heads over 8 KV heads, 128 wide) at 32K context
KV_FP8_CASES = ((1, 32768), (8, 32768), (32, 32768))


def check_kv_fp8_decode_attention(cases=KV_FP8_CASES, device: str = DEV) -> None:
    """Paged decode over e4m3 rows (``engine.kv_dtype: fp8``: words of four codes, each row's scale applied once
    per key) against the fp32 reference over the same codes and scales, at the bf16 kernel's tolerance; the "ref"
    column times the bf16 kernel over the cache dequantized to bf16 (the same context at twice the K/V bytes).
    Both outputs are checked against the reference on every row (the reference walks rows on the host)."""
    from dgpp.kernels.kv_fp8 import dequantize_rows, quantize_rows

    hq, hk, dim, bs = 32, 8, 128, 16
    for batch, ctx in cases:
        blocks = -(-ctx // bs)
        shape = (batch * blocks + 3, bs, hk, dim)
        (kc, ks), (vc, vs) = (quantize_rows(torch.randn(shape, device=device, dtype=BF16)) for _ in range(2))
        k_seen, v_seen = dequantize_rows(kc, ks, BF16), dequantize_rows(vc, vs, BF16)
        tables = torch.randperm(shape[0], device=device)[: batch * blocks].view(batch, blocks).int()
        lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
        q = torch.randn(batch, hq, dim, device=device, dtype=BF16)

        def fp8(q=q, kc=kc, vc=vc, tables=tables, lens=lens, scales=(ks, vs)):
            return pa.paged_decode_attention_triton(q, kc, vc, tables, lens, dim**-0.5, scales=scales)

        def bf16(q=q, k=k_seen, v=v_seen, tables=tables, lens=lens):
            return pa.paged_decode_attention_triton(q, k, v, tables, lens, dim**-0.5)

        ref = pa.paged_decode_attention_ref(q.float(), kc, vc, tables, lens, dim**-0.5, scales=(ks, vs))
        err_fp8, err_bf16 = rel_err(fp8(), ref), rel_err(bf16(), ref)  # both compiled before any capture
        torch.cuda.synchronize()
        t_fp8 = triton.testing.do_bench_cudagraph(fp8, rep=50, return_mode="median") * 1e3
        t_bf16 = triton.testing.do_bench_cudagraph(bf16, rep=50, return_mode="median") * 1e3
        record_times(
            f"paged decode attn e4m3 B={batch} ctx={ctx} 32/8x128",
            err_fp8,
            1e-2,
            t_fp8,
            t_bf16,
            float(lens.sum()) * hk * (2 * dim + 8),
            ref_label="bf16 kernel",
            note=f"  bf16 kernel err {err_bf16:.2e}",
        )
