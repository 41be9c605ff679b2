"""Flint on a CUDA machine (not a CI test): the sink / sliding-window attention kernels against their fp32
reference at the release's sizes, chunked == one-shot bits through the ring, then decode tok/s of the real Flint
geometry (random weights, experts packed per projection as the export ships them) against the memory roofline.

    source tests/perf/device_env.sh && python3 tests/perf/check_flint_cuda.py --layers 49 --batches 1,8

Prints a table last; exits non-zero when a check fails. Needs torch, triton, structlog, msgspec, pluggy.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

HQ, HK, DIM, WINDOW = 32, 4, 128, 513


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def kernel_checks(failures: list[str]) -> list[str]:
    from dgpp.kernels.ring_write import RingWriteInputs, ring_write_triton
    from dgpp.kernels.window_attention import window_attention_ref, window_attention_triton

    rows_out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    # ring: decode rows at 100 / 513 / 4000 tokens, a 700-row chunk at 2000, a 300-row first chunk, a padding row
    ctx, qlen = [100, 513, 4000, 2000, 0, 0], [1, 1, 1, 700, 300, 1]
    rows = sum(qlen)
    starts = torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=dev)
    lens = ctx_t + torch.tensor(qlen, dtype=torch.int32, device=dev)
    lens[-1] = 0
    q = torch.randn(rows, HQ, DIM, generator=g, device=dev).to(bf)
    k = torch.randn(rows, HK, DIM, generator=g, device=dev).to(bf)
    v = torch.randn(rows, HK, DIM, generator=g, device=dev).to(bf)
    ring_k = torch.randn(8, WINDOW - 1, HK, DIM, generator=g, device=dev).to(bf)
    ring_v = torch.randn(8, WINDOW - 1, HK, DIM, generator=g, device=dev).to(bf)
    slots = torch.tensor([0, 1, 2, 3, 4, -1], device=dev)
    sinks = torch.randn(HQ, generator=g, device=dev)
    args = (q, k, v, ring_k, ring_v, slots, starts, ctx_t, lens, sinks, DIM**-0.5, WINDOW, False)
    err = rel(window_attention_triton(*args)[:-1], window_attention_ref(*args)[:-1])
    rows_out.append(f"ring window attention, {rows} rows bf16: rel err {err:.2e}")
    if not err < 1e-2:
        failures.append(f"ring attention rel err {err}")
    # paged full attention with sinks: decode rows at 8192 and 300 tokens, a 512-row chunk at 1024
    bs, ctx, qlen = 16, [8191, 299, 1024], [1, 1, 512]
    rows = sum(qlen)
    starts = torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=dev)
    lens = ctx_t + torch.tensor(qlen, dtype=torch.int32, device=dev)
    blocks = 3 * 8192 // bs
    k_cache = torch.randn(blocks, bs, HK, DIM, generator=g, device=dev).to(bf)
    v_cache = torch.randn(blocks, bs, HK, DIM, generator=g, device=dev).to(bf)
    tables = torch.randperm(blocks, device=dev, generator=g)[: 3 * (8192 // bs)].view(3, -1).int()
    qp = torch.randn(rows, HQ, DIM, generator=g, device=dev).to(bf)
    args = (qp, None, None, k_cache, v_cache, tables, starts, ctx_t, lens, sinks, DIM**-0.5, 0, True)
    ref = window_attention_ref(*args)
    err = rel(window_attention_triton(*args), ref)
    rows_out.append(f"paged sink attention, {rows} rows bf16 (8K context): rel err {err:.2e}")
    if not err < 1e-2:
        failures.append(f"paged sink attention rel err {err}")
    # the same two decode rows through the split-context kernel the full layers' decode rows take
    from dgpp.nn.exact.attention import paged_decode_attention_fixed

    split = paged_decode_attention_fixed(
        qp[:2], k_cache, v_cache, tables[:2], lens[:2], DIM**-0.5, sinks=sinks
    )
    err = rel(split, ref[:2])
    rows_out.append(f"paged sink attention, 2 decode rows split-context bf16 (8K context): rel err {err:.2e}")
    if not err < 1e-2:
        failures.append(f"split-context sink attention rel err {err}")
    # one 1500-token prompt: one shot vs 256-token chunks through the ring, bitwise
    n = 1500
    q1 = torch.randn(n, HQ, DIM, generator=g, device=dev).to(bf)
    k1 = torch.randn(n, HK, DIM, generator=g, device=dev).to(bf)
    v1 = torch.randn(n, HK, DIM, generator=g, device=dev).to(bf)

    def run(chunk: int) -> torch.Tensor:
        rk = torch.zeros(1, WINDOW - 1, HK, DIM, dtype=bf, device=dev)
        rv = torch.zeros_like(rk)
        outs = []
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            st = torch.tensor([0, e - s], dtype=torch.int32, device=dev)
            c = torch.tensor([s], dtype=torch.int32, device=dev)
            ln = torch.tensor([e], dtype=torch.int32, device=dev)
            sl = torch.tensor([0], device=dev)
            outs.append(
                window_attention_triton(
                    q1[s:e], k1[s:e], v1[s:e], rk, rv, sl, st, c, ln, sinks, DIM**-0.5, WINDOW, False
                )
            )
            ring_write_triton(RingWriteInputs(k1[s:e], v1[s:e], rk, rv, sl, st, c, ln))
        return torch.cat(outs)

    whole = run(n)
    same = all(torch.equal(run(c), whole) for c in (1, 256, 511))
    rows_out.append(
        f"ring chunks 1/256/511 vs one shot (1500 tokens): {'bit-identical' if same else 'DIFFER'}"
    )
    if not same:
        failures.append("chunked ring attention differs from one shot")
    return rows_out


def rate_line(label: str, seconds: float, batch: int, step_bytes: float, bandwidth: float) -> str:
    """One decode measurement against the roofline of the bytes a step reads."""
    return (
        f"{label}: {seconds * 1e3:.2f} ms/step, {batch / seconds:.1f} tok/s, {step_bytes / 1e9:.2f} GB/step, "
        f"{step_bytes / seconds / 1e9:.0f} GB/s = {100 * step_bytes / seconds / bandwidth:.1f}% of copy bw "
        f"(roofline {bandwidth / step_bytes * batch:.0f} tok/s)"
    )


def release(blocks, slots, tables: list[list[int]], ids: list[int]) -> None:
    """Give a benchmark's sequences' blocks and slots back."""
    for table, slot in zip(tables, ids, strict=True):
        for block in table:
            blocks.decref(block)
        slots.free(slot)


def fill_random(model: torch.nn.Module) -> None:
    """Random weights of the right kind: floats N(0, 0.02) (scales positive), packed codes random bytes."""
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype in (torch.uint8, torch.int8, torch.int32):
                p.copy_(
                    torch.randint(0, 127, p.shape, generator=g, device="cuda", dtype=torch.int32).to(p.dtype)
                )
            elif "scale" in name.rsplit(".", 1)[-1]:
                p.copy_((torch.rand(p.shape, generator=g, device="cuda") * 0.01 + 0.005).to(p.dtype))
            else:
                p.copy_((torch.randn(p.shape, generator=g, device="cuda") * 0.02).to(p.dtype))


def decode_bench(layers: int, batches: list[int], context: int, steps: int, bandwidth: float) -> list[str]:
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.offline import make_pools
    from dgpp.quant.apply import quantize_modules
    from dgpp_flint.config import FlintArchConfig
    from dgpp_flint.model import FlintForCausalLM
    from dgpp_flint.testing import FLINT_RELEASE, RELEASE_LAYOUT, quantization_config

    hf = {
        **FLINT_RELEASE,
        "num_hidden_layers": layers,
        "layer_types": None,
        "quantization_config": quantization_config({i: f for i, f in RELEASE_LAYOUT.items() if i < layers}),
    }
    cfg = FlintArchConfig.from_hf_config(hf)
    with torch.device("cuda"):
        model = FlintForCausalLM(cfg, dtype=torch.bfloat16)
        quantize_modules(model, hf)
    fill_random(model)
    model.eval()
    # bytes a step must read: every non-expert weight but the embedding table, the routed experts it picks
    expert_bytes = {}
    other = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            layer = name.split(".")[2]
            expert_bytes[layer] = expert_bytes.get(layer, 0) + p.numel() * p.element_size()
        elif "embed_tokens" not in name:
            other += p.numel() * p.element_size()
    full = sum(1 for t in cfg.layer_types if t == "full_attention")
    out = []
    for batch in batches:
        picked = min(cfg.num_experts, cfg.num_experts_per_tok * batch) / cfg.num_experts
        kv = batch * (full * context + (layers - full) * min(context, WINDOW - 1)) * HK * DIM * 2 * 2
        step_bytes = other + picked * sum(expert_bytes.values()) + kv
        total = context + steps + 8
        pools, blocks, slots = make_pools(model, [total] * batch, 64)
        for graph in (False, True):
            tables = [blocks.allocate(blocks.blocks_for_tokens(total)) for _ in range(batch)]
            ids = [slots.allocate() for _ in range(batch)]
            try:
                runner = ModelRunner(model, pools, decode_graph=graph, max_batch=batch)
                gen = torch.Generator().manual_seed(batch)
                for t, s in zip(tables, ids, strict=True):
                    runner.step(
                        [
                            SeqWork(
                                s, t, 0, torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist()
                            )
                        ]
                    )
                work = [SeqWork(s, t, context, [7]) for s, t in zip(ids, tables, strict=True)]
                for i in range(3):  # warm-up (and capture)
                    runner.step([SeqWork(w.state_slot, w.block_table, context + i, [7]) for w in work])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(steps):
                    logits = runner.step(
                        [SeqWork(w.state_slot, w.block_table, context + 3 + i, [7]) for w in work]
                    )
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / steps
                assert torch.isfinite(logits).all()
                out.append(
                    rate_line(
                        f"layers {layers} batch {batch} ctx {context} {'graph' if graph else 'eager'}",
                        dt,
                        batch,
                        step_bytes,
                        bandwidth,
                    )
                )
            except Exception as exc:  # report and go on: the table says which mode failed
                out.append(
                    f"layers {layers} batch {batch} {'graph' if graph else 'eager'}: FAILED {type(exc).__name__}: "
                    f"{str(exc)[:200]}"
                )
            finally:
                release(blocks, slots, tables, ids)
            print(out[-1], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=49)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    bandwidth = copy_bandwidth()
    table = [f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)"]
    failures: list[str] = []
    if not args.skip_kernels:
        table += kernel_checks(failures)
        print("\n".join(table), flush=True)
    table += decode_bench(
        args.layers, [int(b) for b in args.batches.split(",")], args.context, args.steps, bandwidth
    )
    return finish(table, failures)


def finish(table: list[str], failures: list[str]) -> int:
    """Print the summary table and the failed checks; the exit status (1 when a check failed)."""
    print("\n== summary ==\n" + "\n".join(table))
    if failures:
        print("FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
