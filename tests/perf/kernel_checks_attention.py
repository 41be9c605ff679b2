"""Attention kernels at real sizes on the GPU: paged decode (with its split sweep) and prefill (with its tile sweep)."""

# ruff: noqa: B023  (each timing lambda runs before its loop variables move on)

from __future__ import annotations

import torch
import triton.testing
from kernel_checks_record import BF16, DEV, record, rel_err

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
