"""Prefill-size launches of six kernels on a GPU, each against what it replaced, with its exactness:

- the fp32 router's fixed-order product (``dgpp.nn.exact.gemm.FP32_TILE``) over an 8,192-token prompt at
  MiMo-V2.6's shape: time against the decode tile, and every sampled row's bits against the row alone (decode);
- the gated stream mix (``dgpp.kernels.hyper_streams``) at Qwen3.8-Flash-Next's shape: time at 1, 64 and 8,192
  tokens, the largest difference from the torch reference, the last token alone == among all;
- the chunked gated delta rule's chunk walk (``dgpp.kernels.delta_chunk_walk``) at Qwen3.5-122B's (8 value
  heads a rank at TP 8, and the 64 of one device, as ``dgpp bench --geometry qwen3.5-122b-a10b-24l@8`` runs them)
  and Qwen3.8-Flash-Next's (48) shapes, 8,192 tokens: time against the torch products and
  the largest relative difference; and the whole chunked form either way;
- its per-chunk UT transform in one launch (``dgpp.kernels.delta_chunk_prep``) at the same shapes, bf16 q/k/v:
  time against the torch products, each operand's largest relative difference, and the whole chunked form either
  way;
- a full-attention layer's prompt rows four to a program (``dgpp.kernels.full_attention_rows``) at MiMo-V2.6's
  shape on 4 and 8 warps: time against one row a program, every row's bits against it and a prompt cut in two
  chunks against the prompt at once;
- the bf16 grouped expert GEMM (``dgpp.kernels.moe``) over a prompt at MiMo-V2.6's and Qwen3.5-122B's expert
  shapes per rank: time and TFLOP/s per tile, and each tile's bits against the default tile's.

    python3 tests/perf/check_prefill_kernels.py [--tokens 8192] [--only router,stream_mix,chunk_walk,chunk_prep,full_attention_rows,
        moe_tiles]

Exits non-zero when a row-exactness check fails. Not a CI test.
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "dgpp-core" / "src")]

import torch  # noqa: E402
import triton.testing  # noqa: E402

FAILS: list[str] = []


# (label, value heads, key heads) of the delta-rule parts, 128 x 128 heads
DELTA_RULE_HEADS = (
    ("Qwen3.5-122B, a TP-8 rank", 8, 2),
    ("Qwen3.5-122B, one device", 64, 16),
    ("Qwen3.8-Flash-Next", 48, 16),
)


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50) * 1e3


def router(tokens: int) -> None:
    from dgpp.kernels.gemv import multi_linear_triton
    from dgpp.nn.exact import gemm as exact_gemm
    from dgpp.nn.exact.gemm import fixed_order_linear

    x = torch.randn(tokens, 4096, device="cuda")
    ws = [torch.randn(256, 4096, device="cuda") * 4096**-0.5]
    new = fixed_order_linear(x, ws)[0]
    # what the call took before FP32_TILE: the decode split's K step under the wide output tile
    old_tile = exact_gemm._wide_tile(tokens, [256], 256, 4, 1, 4, 64)
    old = multi_linear_triton(x, ws, tile=old_tile, bm=64)[0]
    rows = sorted({0, 1, 63, 64, tokens // 2, tokens - 1})
    same = all(torch.equal(fixed_order_linear(x[r : r + 1], ws)[0][0], new[r]) for r in rows)
    if not same:
        FAILS.append("router rows")
    new_us = _us(lambda: fixed_order_linear(x, ws))
    old_us = _us(lambda: multi_linear_triton(x, ws, tile=old_tile, bm=64))
    print(
        f"fp32 router {tokens}x4096 @ 256: FP32_TILE {new_us:.0f} us, before {old_tile} {old_us:.0f} us, "
        f"rows alone == in the prompt {same}, same as before {torch.equal(new, old)}",
        flush=True,
    )


def stream_mix(tokens: int) -> None:
    from dgpp.kernels import hyper_streams as hs

    streams, hidden, rank = 4, 2560, 320
    up = torch.randn(streams * hidden, rank, device="cuda", dtype=torch.bfloat16) * rank**-0.5
    for n in (1, 64, tokens):
        normed = torch.randn(n, streams * hidden, device="cuda", dtype=torch.bfloat16)
        low = torch.randn(n, rank, device="cuda", dtype=torch.bfloat16)
        step = hs.StreamMixInputs(normed, low, up, streams)
        out = hs.stream_mix_triton(step)
        err = float((out.float() - hs.stream_mix_ref(step).float()).abs().max())
        alone = hs.stream_mix_triton(step._replace(normed=normed[-1:], low=low[-1:]))
        same = bool(torch.equal(alone[0], out[-1]))
        if not same:
            FAILS.append(f"stream mix {n}")
        print(
            f"stream mix {n} tokens: {_us(lambda s=step: hs.stream_mix_triton(s)):.1f} us, max diff vs torch "
            f"{err:.2e}, last token alone == among all {same}",
            flush=True,
        )


def chunk_walk(tokens: int) -> None:
    from dgpp.kernels import delta_chunk_walk as walk
    from dgpp.nn import gated_delta_rule as rule

    chunk, dk, dv = rule.CHUNK_SIZE, 128, 128
    for label, heads, k_heads in DELTA_RULE_HEADS:
        n = tokens // chunk
        g = torch.Generator(device="cuda").manual_seed(heads)

        def rand(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device="cuda") * scale

        ops = walk.ChunkWalkInputs(
            rand(heads, n, chunk, dv),
            rand(heads, n, chunk, dk, scale=dk**-0.5),
            rand(heads, n, chunk, dk, scale=dk**-0.5),
            rand(heads, n, chunk, chunk, scale=chunk**-0.5).tril(),
            rand(heads, n, chunk, dk, scale=dk**-0.5),
            torch.rand(heads, n, generator=g, device="cuda") * 0.2 + 0.8,
            rand(heads, dk, dv),
        )
        out, state = walk.chunk_walk_triton(ops)
        ref_out, ref_state = walk.chunk_walk_ref(ops)
        rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in ((out, ref_out), (state, ref_state)))
        new_us, old_us = _us(lambda: walk.chunk_walk_triton(ops)), _us(lambda: walk.chunk_walk_ref(ops))
        q = torch.randn(1, tokens, k_heads, dk, device="cuda")
        k = torch.randn(1, tokens, k_heads, dk, device="cuda")
        v = torch.randn(1, tokens, heads, dv, device="cuda")
        gate = -torch.nn.functional.softplus(torch.randn(1, tokens, heads, device="cuda")) * 0.1
        beta = torch.rand(1, tokens, heads, device="cuda")
        start = torch.zeros(1, heads, dk, dv, device="cuda")

        def whole(fn, args=(q, k, v, gate, beta, start)):
            rule.chunk_walk = fn
            return rule.chunked_gated_delta_rule(*args)

        a, b = whole(walk.chunk_walk_triton), whole(walk.chunk_walk_ref)
        whole_rel = float((a[0] - b[0]).abs().max() / b[0].abs().max())
        whole_new, whole_old = (
            _us(lambda: whole(walk.chunk_walk_triton)),
            _us(lambda: whole(walk.chunk_walk_ref)),
        )
        rule.chunk_walk = walk.chunk_walk
        print(
            f"chunk walk {label} ({heads} heads, {n} chunks): {new_us:.0f} us vs torch {old_us:.0f} us, "
            f"max rel diff {rel:.1e}; whole chunked form {whole_new:.0f} vs {whole_old:.0f} us, "
            f"max rel diff {whole_rel:.1e}",
            flush=True,
        )


def chunk_prep(tokens: int) -> None:
    from dgpp.kernels import delta_chunk_prep as prep
    from dgpp.nn import gated_delta_rule as rule

    dk, dv = 128, 128
    for label, heads, k_heads in DELTA_RULE_HEADS:
        g = torch.Generator(device="cuda").manual_seed(heads)
        q, k = (torch.randn(1, tokens, k_heads, dk, generator=g, device="cuda").bfloat16() for _ in range(2))
        v = torch.randn(1, tokens, heads, dv, generator=g, device="cuda").bfloat16()
        gate = -torch.nn.functional.softplus(torch.randn(1, tokens, heads, generator=g, device="cuda")) * 0.1
        beta = torch.rand(1, tokens, heads, generator=g, device="cuda").bfloat16()
        start = torch.randn(1, heads, dk, dv, generator=g, device="cuda") * 0.1
        args = (q, k, v, gate, beta, start, rule.CHUNK_SIZE)
        got, want = prep.chunk_prep_triton(*args), rule.chunk_operands(*args)
        diffs = " ".join(
            f"{name} {float((a - b).abs().max() / b.abs().max()):.1e}"
            for name, a, b in zip(got._fields, got, want, strict=True)
        )
        new_us, old_us = _us(lambda: prep.chunk_prep_triton(*args)), _us(lambda: rule.chunk_operands(*args))

        def whole(fn):
            rule.chunk_prep_triton = fn
            return rule.chunked_gated_delta_rule(*args)

        a, b = whole(prep.chunk_prep_triton), whole(rule.chunk_operands)
        whole_rel = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))
        whole_new, whole_old = (
            _us(lambda: whole(prep.chunk_prep_triton)),
            _us(lambda: whole(rule.chunk_operands)),
        )
        rule.chunk_prep_triton = prep.chunk_prep_triton
        print(
            f"chunk prep {label} ({heads} heads, {tokens // rule.CHUNK_SIZE} chunks): {new_us:.0f} us vs torch "
            f"{old_us:.0f} us; max rel diff {diffs}; whole chunked form {whole_new:.0f} vs {whole_old:.0f} us, "
            f"max rel diff {whole_rel:.1e}",
            flush=True,
        )


def full_attention_rows(tokens: int) -> None:
    from dgpp.kernels import full_attention_rows as rows_kernel
    from dgpp.kernels.window_attention import window_attention_triton

    hq, hk, dim, v_dim, block = 16, 1, 192, 128, 16  # MiMo-V2.6's full-attention layer at TP 4
    blocks = tokens // block + 1
    bf16 = torch.bfloat16
    q = torch.randn(tokens, hq, dim, device="cuda", dtype=bf16)
    k_cache = torch.randn(blocks, block, hk, dim, device="cuda", dtype=bf16)
    v_cache = torch.randn(blocks, block, hk, v_dim, device="cuda", dtype=bf16)
    table = torch.randperm(blocks, device="cuda").int()[None]
    sinks = torch.randn(hq, device="cuda")

    def attend(first: int, count: int, shared: bool) -> torch.Tensor:
        """Rows ``first ..`` of the prompt as one chunk over the keys before them."""
        args = (
            q[first : first + count],
            None,
            None,
            k_cache,
            v_cache,
            table,
            torch.tensor([0, count], dtype=torch.int32, device="cuda"),
            torch.tensor([first], dtype=torch.int32, device="cuda"),
            torch.tensor([first + count], dtype=torch.int32, device="cuda"),
            sinks,
            dim**-0.5,
            0,
            True,
        )
        if not shared:
            return window_attention_triton(*args)
        row_blocks = rows_kernel.prompt_row_blocks([count], q.device)
        return rows_kernel.full_attention_rows_triton(*args[:1], *args[3:11], row_blocks)

    alone = attend(0, tokens, False)
    old_us = _us(lambda: attend(0, tokens, False))
    cut = tokens // 2 + 3  # a chunk boundary inside a four-row block of the one-shot call
    for warps in (4, 8):
        rows_kernel._WARPS = warps
        shared = attend(0, tokens, True)
        chunked = torch.cat([attend(0, cut, True), attend(cut, tokens - cut, True)])
        as_one_row, as_chunks = bool(torch.equal(shared, alone)), bool(torch.equal(shared, chunked))
        if not as_chunks:
            FAILS.append(f"full attention rows chunked ({warps} warps)")
        print(
            f"full attention {tokens} prompt rows ({hq} q / {hk} kv heads, {dim}/{v_dim}), {warps} warps: four "
            f"rows a program {_us(lambda: attend(0, tokens, True)):.0f} us, one row a program {old_us:.0f} us; "
            f"the one-row kernel's bits {as_one_row}, chunked == one shot {as_chunks}",
            flush=True,
        )


def moe_tiles(tokens: int) -> None:
    from dgpp.kernels import moe

    bf16 = torch.bfloat16
    for label, hidden, inter, experts in (
        ("MiMo-V2.6@4", 4096, 512, 256),
        ("Qwen3.5-122B, a TP-8 rank", 3072, 128, 256),
    ):
        g = torch.Generator(device="cuda").manual_seed(hidden)
        x = torch.randn(tokens, hidden, device="cuda", dtype=bf16, generator=g)
        gate_up = (
            torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=bf16, generator=g) * hidden**-0.5
        )
        down = torch.randn(experts, hidden, inter, device="cuda", dtype=bf16, generator=g) * inter**-0.5
        scores = torch.randn(tokens, experts, device="cuda", generator=g)
        weights, ids = scores.softmax(-1).topk(8, dim=-1)
        base = moe.fused_moe_triton(x, gate_up, down, weights, ids, tile=moe.DEFAULT_TILE)
        flops = tokens * 8 * 3 * 2 * hidden * inter
        for tile in (moe.DEFAULT_TILE, (128, 64, 8, 3), (128, 64, 4, 3), (256, 64, 8, 3), (128, 32, 4, 4)):
            try:
                out = moe.fused_moe_triton(x, gate_up, down, weights, ids, tile=tile)
                us = _us(lambda t=tile: moe.fused_moe_triton(x, gate_up, down, weights, ids, tile=t))
            except Exception as e:  # a tile that does not fit
                print(f"moe {label} tile {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            print(
                f"moe {label} {tokens} tokens tile {tile}: {us:.0f} us, {flops / us / 1e6:.0f} TFLOP/s, "
                f"bits == {moe.DEFAULT_TILE} {bool(torch.equal(out, base))}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--only", default="", help="parts to run, comma separated (default: all)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for part in (router, stream_mix, chunk_walk, chunk_prep, full_attention_rows, moe_tiles):
        if args.only and part.__name__ not in args.only.split(","):
            continue
        try:
            part(args.tokens)
        except Exception as e:  # one failing part leaves the others' lines
            FAILS.append(f"{part.__name__}: {type(e).__name__}: {e}")
            print(f"{part.__name__} failed: {type(e).__name__}: {e}", flush=True)
    print("FAILED: " + ", ".join(FAILS) if FAILS else "all checks ok")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
