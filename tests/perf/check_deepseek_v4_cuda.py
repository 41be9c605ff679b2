"""DeepSeek-V4 attention on a CUDA machine (not a CI test): the batched, CUDA-graph-safe decode path of compressed
attention (``dgpp.nn.compressed_decode``: compressor pooling with masked stores, the lightning indexer's top-k,
one softmax over window + entries + sinks) against the per-row reference (``dgpp.nn.compressed_attention``) at
the release's sizes (64 heads x 512 over one latent, window 128, CSA ratio 4 with a 64-head x 128 indexer
keeping 512 entries, HCA ratio 128), bf16, after prompts long enough that the indexer selects; the prefill path
batched over a chunk's rows (``dgpp.nn.compressed_prefill`` with ``dgpp.kernels.compressed_attention``) against
the per-row reference on the same prompts (700 / 2,100 / 4,001 rows), timed; then the sliding window kernel (K
read as V) against its reference, chunked vs one shot.

    source tests/perf/device_env.sh && python3 tests/perf/check_deepseek_v4_cuda.py
    python3 -m dgpp.cli bench --geometry deepseek-v4-flash-8l --hf-cases '' --cases 128x1x64,128x8x64 \
        --check-cases 128x3x16        # decode tok/s of the layer-scaled geometry vs the roofline

Prints a table last; exits non-zero when a check fails. Needs torch, triton, structlog, msgspec, pluggy.
"""

from __future__ import annotations

import sys
import time

import torch
from check_flint_cuda import finish

CONTEXTS = (
    700,
    2100,
    4001,
)  # CSA: 175 entries (all kept), 525 (the indexer keeps 512); HCA: 5, 16, 31 entries
STEPS = 6
BLOCK = 16


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def build_layer(layer_idx: int):
    from dgpp.bench.models import geometries
    from dgpp_deepseek.attention import DeepseekV4Attention
    from dgpp_deepseek.config import DeepseekV4ArchConfig

    cfg = DeepseekV4ArchConfig.from_hf_config({**geometries()["deepseek-v4-flash-8l"], "dtype": "bfloat16"})
    g = torch.Generator(device="cuda").manual_seed(layer_idx)
    with torch.device("cuda"):
        layer = DeepseekV4Attention(cfg, layer_idx, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device="cuda"))
            elif name.endswith(("ape", "attn_sink")):
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.5)
            else:
                p.copy_((torch.randn(p.shape, generator=g, device="cuda") * 0.02).to(p.dtype))
    return cfg, layer.eval()


@torch.no_grad()
def check_layer(layer_idx: int, failures: list[str]) -> list[str]:
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.step.pools import CachePools

    cfg, layer = build_layer(layer_idx)
    kind = cfg.layer_types[layer_idx]
    need = [-(-(c + STEPS) // BLOCK) for c in CONTEXTS]
    tables, start = [], 0
    for n in need:
        tables.append(list(range(start, start + n)))
        start += n
    g = torch.Generator(device="cuda").manual_seed(100 + layer_idx)
    pools = CachePools(layer.cache_entries(torch.bfloat16), start, BLOCK, len(CONTEXTS), device="cuda")
    t0 = time.perf_counter()
    for i, ctx in enumerate(CONTEXTS):  # prefill, in chunks
        for s in range(0, ctx, 1024):
            e = min(ctx, s + 1024)
            x = torch.randn(e - s, cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
            layer(x, build_batch([SeqWork(i, tables[i], s, [0] * (e - s))], pools, "cuda"))
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    copies = {}
    for mode in ("reference", "batched"):
        copy = CachePools(layer.cache_entries(torch.bfloat16), start, BLOCK, len(CONTEXTS), device="cuda")
        for name in pools.kv:
            copy.kv[name][0].copy_(pools.kv[name][0])
        for name in pools.state:
            for t in pools.state[name]:
                copy.state[name][t].copy_(pools.state[name][t])
        copies[mode] = copy
    xs = [
        torch.randn(len(CONTEXTS), cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        for _ in range(STEPS)
    ]
    outs, times = {}, {}
    for mode, copy in copies.items():
        layer.core.batched_decode = mode == "batched"
        rows = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for step, x in enumerate(xs):
            work = [SeqWork(i, tables[i], c + step, [0]) for i, c in enumerate(CONTEXTS)]
            rows.append(layer(x, build_batch(work, copy, "cuda")))
        torch.cuda.synchronize()
        times[mode] = (time.perf_counter() - t0) / STEPS
        outs[mode] = torch.stack(rows)
    layer.core.batched_decode = None
    out_err = rel(outs["batched"], outs["reference"])
    cache_err = max(rel(copies["batched"].kv[n][0], copies["reference"].kv[n][0]) for n in pools.kv)
    state_err = max(
        rel(copies["batched"].state[n][t], copies["reference"].state[n][t])
        for n in pools.state
        for t in pools.state[n]
    )
    lines = [
        f"{kind} (layer {layer_idx}), contexts {CONTEXTS}, {STEPS} decode steps bf16: output rel err {out_err:.2e}, "
        f"entries rel err {cache_err:.2e}, rings/buffers rel err {state_err:.2e}",
        f"  prefill {prefill_s:.2f} s; decode step {times['reference'] * 1e3:.1f} ms reference, "
        f"{times['batched'] * 1e3:.2f} ms batched",
    ]
    # bf16 sums in another order; a top-k near-tie may swap one entry for the next (same order of error)
    if not (out_err < 2e-2 and cache_err < 1e-2 and state_err < 1e-6):
        failures.append(f"{kind} decode path vs reference: {out_err:.2e} / {cache_err:.2e} / {state_err:.2e}")
    return lines


def _prefill(layer, pools, tables, xs: list[torch.Tensor], chunk: int) -> tuple[torch.Tensor, float]:
    """Every prompt of ``xs`` through ``layer`` in steps of ``chunk`` rows: (all rows' outputs, seconds)."""
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork

    outs = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, x in enumerate(xs):
        for s in range(0, x.shape[0], chunk):
            e = min(x.shape[0], s + chunk)
            outs.append(layer(x[s:e], build_batch([SeqWork(i, tables[i], s, [0] * (e - s))], pools, "cuda")))
    torch.cuda.synchronize()
    return torch.cat(outs), time.perf_counter() - t0


@torch.no_grad()
def check_prefill(layer_idx: int, failures: list[str]) -> list[str]:
    """The prefill path batched over a chunk's rows (``dgpp.nn.compressed_prefill``: batched pooling, the
    indexer's scores and top-k for every row at once, the compressed-attention kernel) against the per-row
    reference on the prompts of ``CONTEXTS`` in 1024-row chunks: outputs, cache contents, time; then one
    shot and other cuts (not multiples of the ratios) against the 1024-row chunks."""
    from dgpp.step.pools import CachePools

    cfg, layer = build_layer(layer_idx)
    kind = cfg.layer_types[layer_idx]
    need = [-(-c // BLOCK) for c in CONTEXTS]
    tables, start = [], 0
    for n in need:
        tables.append(list(range(start, start + n)))
        start += n
    g = torch.Generator(device="cuda").manual_seed(200 + layer_idx)
    xs = [torch.randn(c, cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16) for c in CONTEXTS]

    def fresh() -> CachePools:
        return CachePools(layer.cache_entries(torch.bfloat16), start, BLOCK, len(CONTEXTS), device="cuda")

    runs = {}
    for mode in ("reference", "warm-up", "batched"):  # the warm-up compiles the kernels
        layer.core.per_row_prefill = mode == "reference"
        pools = fresh()
        runs[mode] = (*_prefill(layer, pools, tables, xs, 1024), pools)
    layer.core.per_row_prefill = False
    (ref, ref_s, ref_pools), (got, got_s, got_pools) = runs["reference"], runs["batched"]
    out_err = rel(got, ref)
    same_cache = all(torch.equal(got_pools.kv[n][0], ref_pools.kv[n][0]) for n in ref_pools.kv) and all(
        torch.equal(got_pools.state[n][t], ref_pools.state[n][t])
        for n in ref_pools.state
        for t in ref_pools.state[n]
    )
    # other cuts: the layer's projections take cuBLAS per chunk outside engine.batch_invariant, so rows may move in
    # the last bits with the cut; the tolerance is the reference's
    cuts = {c: rel(_prefill(layer, fresh(), tables, xs, c)[0], got) for c in (max(CONTEXTS), 333, 1001)}
    cut_text = ", ".join(f"{c}: {'bit-identical' if e == 0 else f'{e:.1e}'}" for c, e in cuts.items())
    lines = [
        f"{kind} (layer {layer_idx}) prefill of {CONTEXTS} in 1024-row chunks, bf16: batched vs per-row reference "
        f"output rel err {out_err:.2e}, caches {'identical' if same_cache else 'DIFFER'}; cuts vs 1024 ({cut_text})",
        f"  prefill time: per-row reference {ref_s:.2f} s, batched {got_s * 1e3:.1f} ms ({ref_s / got_s:.0f}x)",
    ]
    # bf16: the kernel's online softmax and the indexer's scores sum in another order than the reference; a top-k
    # near-tie may swap one entry for the next (the decode check's tolerance)
    if not (out_err < 2e-2 and same_cache and max(cuts.values()) < 2e-2):
        failures.append(f"{kind} prefill path: rel err {out_err:.2e}, caches {same_cache}, cuts {cuts}")
    return lines


@torch.no_grad()
def check_sliding(failures: list[str]) -> list[str]:
    """The sliding layer's window kernel with K read as V, one 1500-row prompt one shot vs chunks, bitwise."""
    from dgpp.kernels.window_attention import ring_write_triton, window_attention_ref, window_attention_triton

    g = torch.Generator(device="cuda").manual_seed(7)
    heads, dim, window, n = 64, 512, 128, 1500
    q = torch.randn(n, heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(n, 1, dim, generator=g, device="cuda").to(torch.bfloat16)
    sinks = torch.randn(heads, generator=g, device="cuda")

    def run(chunk: int, fn) -> torch.Tensor:
        ring = torch.zeros(1, window - 1, 1, dim, dtype=torch.bfloat16, device="cuda")
        outs = []
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            st = torch.tensor([0, e - s], dtype=torch.int32, device="cuda")
            c = torch.tensor([s], dtype=torch.int32, device="cuda")
            ln = torch.tensor([e], dtype=torch.int32, device="cuda")
            sl = torch.tensor([0], device="cuda")
            outs.append(
                fn(q[s:e], kv[s:e], kv[s:e], ring, ring, sl, st, c, ln, sinks, dim**-0.5, window, False)
            )
            ring_write_triton(kv[s:e], kv[s:e], ring, ring, sl, st, c, ln)
        return torch.cat(outs)

    whole = run(n, window_attention_triton)
    err = rel(whole, run(n, window_attention_ref))
    same = all(torch.equal(run(c, window_attention_triton), whole) for c in (1, 256, 511))
    if not (err < 1e-2 and same):
        failures.append(f"sliding K=V window attention: rel err {err:.2e}, chunks bit-identical {same}")
    return [
        f"sliding window 128, 64 heads x 512, K as V, 1500 rows bf16: rel err {err:.2e}; chunks 1/256/511 vs "
        f"one shot {'bit-identical' if same else 'DIFFER'}"
    ]


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    failures: list[str] = []
    table = check_sliding(failures)
    print(table[-1], flush=True)
    for layer_idx in (2, 3):  # CSA, HCA in the layer-scaled geometry
        table += check_prefill(layer_idx, failures)
        print("\n".join(table[-2:]), flush=True)
    for layer_idx in (2, 3):
        table += check_layer(layer_idx, failures)
        print("\n".join(table[-2:]), flush=True)
    return finish(table, failures)


if __name__ == "__main__":
    sys.exit(main())
