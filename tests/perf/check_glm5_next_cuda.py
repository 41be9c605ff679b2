"""GLM-5.3-Flash (glm5_next) on a CUDA machine (not a CI test): the KDA recurrent decode step (per-key-channel
decay) against its fp32 reference at the release's sizes (64 heads of 128 x 128 state), a row's bits alone vs in a
batch, its timing against the state bytes it reads and writes; the hyper-connection kernels against their torch
chain (``kernel_checks_hyper``), then decode tok/s of the layer-scaled geometry
``glm-5.3-flash-6l`` (random bf16 weights), eager and under decode graphs, against the roofline of the bytes a step
reads (``dgpp.bench.step_bytes``: weights, routed experts as picked, the cache rows and the KDA state read and
written), and whether the two modes' greedy tokens agree. Also the k-pooled indexer's decode selection on its kernels
against its torch path (``indexer_checks``).

    source tests/perf/device_env.sh && python3 tests/perf/check_glm5_next_cuda.py --cases 1x1024,8x1024,32x1024

Prints a table last; exits non-zero when a check fails. Needs torch, triton, structlog, msgspec, pluggy.
"""

from __future__ import annotations

import argparse
import sys

import torch
from check_flint_cuda import finish, rel
from check_glm5_cuda import _timed
from kernel_checks_hyper import hyper_connection_checks

HEADS, DIM = 64, 128  # one KDA layer of the release: 64 heads, 128 x 128 fp32 state each


def kda_kernel_checks(failures: list[str]) -> list[str]:
    from dgpp.kernels.gated_delta import gated_delta_ref, gdn_decode_step_triton

    out: list[str] = []
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    for batch in (1, 8, 32):
        q, k, v = (torch.randn(batch, HEADS, DIM, generator=g, device=dev).to(torch.bfloat16) for _ in "qkv")
        decay = -torch.nn.functional.softplus(torch.randn(batch, HEADS, DIM, generator=g, device=dev))
        beta = torch.rand(batch, HEADS, generator=g, device=dev)
        pool = torch.randn(batch + 1, HEADS, DIM, DIM, generator=g, device=dev) * 0.1
        slots = torch.arange(1, batch + 1, device=dev)
        fresh = torch.zeros(batch, dtype=torch.bool, device=dev)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        args = (q, k, v, decay, beta)
        ref_pool = pool.clone()
        ref = gated_delta_ref(*args, ref_pool, slots, starts, fresh)
        ours_pool = pool.clone()
        ours = gdn_decode_step_triton(*args, ours_pool, slots, fresh)
        err = max(rel(ours, ref), rel(ours_pool, ref_pool))
        alone_pool = pool.clone()
        last = slice(batch - 1, batch)
        alone = gdn_decode_step_triton(*(t[last] for t in args), alone_pool, slots[last], fresh[last])
        same = torch.equal(alone[0], ours[-1]) and torch.equal(alone_pool[batch], ours_pool[batch])
        sec = _timed(gdn_decode_step_triton, *args, pool.clone(), slots, fresh)
        state_bytes = 2 * batch * HEADS * DIM * DIM * 4  # read and written once
        out.append(
            f"KDA decode step batch {batch} (64 heads, 128x128, per-channel decay): rel err {err:.2e}, "
            f"row alone == batched: {'bit-identical' if same else 'DIFFER'}; {sec * 1e6:.0f} us, "
            f"{state_bytes / sec / 1e9:.0f} GB/s of state"
        )
        if not (err < 1e-4 and same):
            failures.append(f"KDA decode batch {batch}: rel err {err}, alone==batched {same}")
    return out


def indexer_checks(failures: list[str]) -> list[str]:
    """The k-pooled indexer's decode selection at the release's sizes (32 heads of 128, kpool 16, 128 pools kept;
    bf16 and e4m3 pooled keys, contexts to 64k): the CUDA path (index-score kernel, radix top-k, expansion) against
    the torch path (the same picks where no two pools' scores come within a rounding of each other at the cut:
    the share of rows picking alike is printed), a row alone == in the batch, eager == a replayed CUDA graph, and
    both paths' times."""
    from types import SimpleNamespace

    from dgpp_glm import glm5_next_indexer_decode as decode

    out: list[str] = []
    dev, heads, dim, kpool, keep, block = "cuda", 32, 128, 16, 128, 64
    g = torch.Generator(device=dev).manual_seed(2)
    lens = [0, 900, 2048, 2049, 5000, 16384, 65536, 40000]
    rows, columns = len(lens), 65536 // block
    for quantized in (False, True):
        keys = torch.randn(rows * columns, block // kpool, dim, generator=g, device=dev).to(torch.bfloat16)
        scales: dict[str, list[torch.Tensor]] = {}
        if quantized:
            keys = (keys.float() * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
            scales["k"] = [torch.full((rows * columns, block // kpool, 1), 1 / 16, device=dev)]
        tables = torch.randperm(rows * columns, device=dev).view(rows, columns).to(torch.int32)
        batch = SimpleNamespace(
            cache=SimpleNamespace(kv={"k": [keys]}, kv_scales=scales, block_size=block),
            block_tables=tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        )
        indexer = SimpleNamespace(
            kpool=kpool, select_pools=keep, select_tail=True, cache_name="k", dtype=torch.bfloat16
        )
        q = torch.randn(rows, heads, dim, generator=g, device=dev).to(torch.bfloat16).float()
        weights = torch.randn(rows, heads, generator=g, device=dev)
        fused = decode.select_decode(indexer, q, weights, batch)  # type: ignore[arg-type]
        original = decode.use_triton
        decode.use_triton = lambda x: False  # type: ignore[assignment]
        try:
            torch_path = decode.select_decode(indexer, q, weights, batch)  # type: ignore[arg-type]
            torch_sec = _timed(decode.select_decode, indexer, q, weights, batch)
        finally:
            decode.use_triton = original  # type: ignore[assignment]
        assert fused is not None and torch_path is not None
        alike = sum(torch.equal(fused.positions[r], torch_path.positions[r]) for r in range(rows))
        last = rows - 1
        one = SimpleNamespace(**vars(batch))
        one.block_tables, one.seq_lens = tables[last:], batch.seq_lens[last:]
        alone = decode.select_decode(indexer, q[last:], weights[last:], one)  # type: ignore[arg-type]
        same = alone is not None and torch.equal(alone.positions[0], fused.positions[last])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = decode.select_decode(indexer, q, weights, batch)  # type: ignore[arg-type]
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured is not None and torch.equal(captured.positions, fused.positions)
        sec = _timed(decode.select_decode, indexer, q, weights, batch)
        out.append(
            f"k-pooled selection {'e4m3' if quantized else 'bf16'} keys, {rows} rows to 64k: rows picking as the "
            f"torch path {alike}/{rows}, counts equal {torch.equal(fused.counts, torch_path.counts)}; alone == "
            f"batched {same}; graph == eager {replayed}; {sec * 1e6:.0f} us vs torch {torch_sec * 1e6:.0f} us"
        )
        if not (same and replayed and torch.equal(fused.counts, torch_path.counts)):
            failures.append(out[-1])
    return out


def decode_bench(geometry: str, cases: list[tuple[int, int]], steps: int, failures: list[str]) -> list[str]:
    from dgpp.bench.decode import copy_bandwidth_gbs, format_table, run_case
    from dgpp.bench.models import build_random_model

    model = build_random_model(geometry, "cuda", torch.bfloat16, seed=1)
    copy = copy_bandwidth_gbs("cuda")
    results, out = [], []
    for batch, context in cases:
        pair = {}
        for graph in (False, True):
            try:
                pair[graph] = run_case(model, context, batch, steps, graph=graph, copy_gbs=copy)
                results.append(pair[graph])
            except Exception as exc:  # report and go on: the table says which case failed
                out.append(f"{geometry} batch {batch} ctx {context} graph={graph}: FAILED {exc!r}"[:400])
                failures.append(out[-1])
        if len(pair) == 2:
            same = pair[False].tokens == pair[True].tokens
            out.append(f"{geometry} batch {batch} ctx {context}: greedy graph == eager: {same}")
            if not same:
                failures.append(out[-1])
    return [f"copy bandwidth {copy:.0f} GB/s (read + write)", format_table(results, copy), *out]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="glm-5.3-flash-6l")
    ap.add_argument("--cases", default="1x1024,8x1024,32x1024", help="batch x context, comma-separated")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    failures: list[str] = []
    table: list[str] = []
    if not args.skip_kernels:
        table += kda_kernel_checks(failures)
        table += indexer_checks(failures)
        table += hyper_connection_checks(failures)
        print("\n".join(table), flush=True)
    cases = [tuple(int(n) for n in case.split("x")) for case in args.cases.split(",")]
    table += decode_bench(args.geometry, cases, args.steps, failures)  # type: ignore[arg-type]
    return finish(table, failures)


if __name__ == "__main__":
    sys.exit(main())
