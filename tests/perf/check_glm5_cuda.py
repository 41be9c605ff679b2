"""Full GLM-5.3 (glm_moe_dsa) on a CUDA machine (not a CI test): the MLA kernels against their fp32 references at
the release's sizes (absorbed attention over the latent cache, dense and over 2048 selected tokens; the per-head
absorption products; the quantized latent / index-key cache write against the torch encoder's bytes), a row's bits
alone vs in a batch, kernel timings, then decode tok/s of the layer-scaled
geometry ``glm-5.3-12l`` (random weights in the int4/int8 group-64 release form) against the roofline of the bytes
a step reads (``dgpp.bench.step_bytes``).

    source tests/perf/device_env.sh && python3 tests/perf/check_glm5_cuda.py --cases 1x1024,8x1024,1x8192

Prints a table last; exits non-zero when a check fails. Needs torch, triton, structlog, msgspec, pluggy.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from check_flint_cuda import copy_bandwidth, finish, rate_line, rel, release

HEADS, LATENT, ROPE, NOPE, V, BS = 64, 512, 64, 192, 256, 64
SCALE = (NOPE + ROPE) ** -0.5


def _timed(fn, *args, iters: int = 20) -> float:
    """Seconds per call of ``fn(*args)`` (CUDA events, after one warm-up call)."""
    fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def kernel_checks(failures: list[str]) -> list[str]:
    from dgpp.kernels.head_matmul import head_matmul_ref, head_matmul_triton
    from dgpp.kernels.mla_attention import mla_attention_ref, mla_attention_triton

    out: list[str] = []
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    blocks = 4 * 8192 // BS
    latent = torch.randn(blocks, BS, 1, LATENT, generator=g, device=dev).to(bf)
    rope = torch.randn(blocks, BS, 1, ROPE, generator=g, device=dev).to(bf)

    def rows(lens: list[int]):
        n = len(lens)
        tables = torch.stack(
            [torch.randperm(blocks, generator=g, device=dev)[: 8192 // BS] for _ in range(n)]
        ).int()
        q_lat = torch.randn(n, HEADS, LATENT, generator=g, device=dev).to(bf)
        q_rot = torch.randn(n, HEADS, ROPE, generator=g, device=dev).to(bf)
        return q_lat, q_rot, tables, torch.tensor(lens, dtype=torch.int32, device=dev)

    # dense decode rows: a padding row, 1 / 700 / 2048 / 8192 tokens
    q_lat, q_rot, tables, lens = rows([0, 1, 700, 2048, 8192])
    args = (q_lat, q_rot, latent, rope, tables, lens, SCALE)
    got = mla_attention_triton(*args)
    err = rel(got[1:], mla_attention_ref(*args)[1:])
    same = all(
        torch.equal(
            mla_attention_triton(
                q_lat[r : r + 1], q_rot[r : r + 1], latent, rope, tables[r : r + 1], lens[r : r + 1], SCALE
            )[0],
            got[r],
        )
        for r in range(5)
    )
    out.append(
        f"MLA absorbed dense, rows at 1/700/2048/8192 tokens bf16: rel err {err:.2e}; "
        f"alone == batched: {'bit-identical' if same else 'DIFFER'}"
    )
    if not (err < 1e-2 and same and torch.equal(got[0], torch.zeros_like(got[0]))):
        failures.append(f"MLA dense rel err {err}, alone==batched {same}")
    # sparse rows: 2048 picked positions of an 8192-token context (ascending, as the indexer gives them)
    q_lat, q_rot, tables, _ = rows([8192] * 8)
    idx = torch.stack(
        [torch.randperm(8192, generator=g, device=dev)[:2048].sort().values for _ in range(8)]
    ).int()
    picked = torch.full((8,), 2048, dtype=torch.int32, device=dev)
    sparse = torch.ones(8, dtype=torch.int32, device=dev)
    args = (q_lat, q_rot, latent, rope, tables, picked, SCALE, idx, sparse)
    err = rel(mla_attention_triton(*args), mla_attention_ref(*args))
    out.append(f"MLA absorbed sparse, 8 rows x 2048 of 8192 tokens bf16: rel err {err:.2e}")
    if not err < 1e-2:
        failures.append(f"MLA sparse rel err {err}")
    # timings: decode batches at 8192 dense and 2048 selected, bytes = latent + rope rows each row reads
    row_bytes = (LATENT + ROPE) * 2
    for batch in (1, 16):
        q_lat, q_rot, tables, lens = rows([8192] * batch)
        sec = _timed(mla_attention_triton, q_lat, q_rot, latent, rope, tables, lens, SCALE)
        out.append(
            f"MLA dense batch {batch} x 8192 tokens: {sec * 1e6:.0f} us, "
            f"{batch * 8192 * row_bytes / sec / 1e9:.0f} GB/s of latent rows"
        )
        idx_b = idx[:1].expand(batch, -1).contiguous()
        sp = torch.ones(batch, dtype=torch.int32, device=dev)
        pk = torch.full((batch,), 2048, dtype=torch.int32, device=dev)
        sec = _timed(mla_attention_triton, q_lat, q_rot, latent, rope, tables, pk, SCALE, idx_b, sp)
        out.append(
            f"MLA sparse batch {batch} x 2048 picked: {sec * 1e6:.0f} us, "
            f"{batch * 2048 * row_bytes / sec / 1e9:.0f} GB/s of latent rows"
        )
    # absorption products at 16 rows: q_nope . W_uk and o_lat . W_uv^T (W_uv read transposed in place)
    kv_b = (torch.randn(HEADS, NOPE + V, LATENT, generator=g, device=dev) * 0.05).to(bf)
    w_uk, w_uv = kv_b.split((NOPE, V), dim=1)
    q_nope = torch.randn(16, HEADS, NOPE, generator=g, device=dev).to(bf)
    o_lat = torch.randn(16, HEADS, LATENT, generator=g, device=dev).to(bf)
    for name, x, w in (("q_nope.W_uk", q_nope, w_uk), ("o_lat.W_uv^T", o_lat, w_uv.transpose(1, 2))):
        got = head_matmul_triton(x, w)
        err = rel(got, head_matmul_ref(x, w))
        same = torch.equal(head_matmul_triton(x[3:4], w)[0], got[3])
        sec = _timed(head_matmul_triton, x[:1], w)
        out.append(
            f"absorption {name} 16 rows: rel err {err:.2e}, alone == batched: "
            f"{'bit-identical' if same else 'DIFFER'}; 1 row {sec * 1e6:.0f} us"
        )
        if not (err < 1e-2 and same):
            failures.append(f"head_matmul {name} rel err {err}, alone==batched {same}")
    return out


def _write_pools(fmt: str, width: int, rope_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, row scales, k_rot) pools of 8192 tokens on the GPU, the codes' bytes not zero (a skipped row keeps
    them)."""
    from dgpp.step.cache_spec import KV_FP8, fp4_row_bytes

    blocks = 8192 // BS
    stored = width if fmt == "fp8" else fp4_row_bytes(width)
    cache = torch.full((blocks, BS, 1, stored), 0xA5, dtype=torch.uint8, device="cuda")
    rope = torch.zeros(blocks, BS, 1, rope_width, dtype=torch.bfloat16, device="cuda")
    scales = torch.zeros(blocks, BS, 1, 1, device="cuda")
    return (cache.view(KV_FP8) if fmt == "fp8" else cache), scales, rope


def write_checks(failures: list[str]) -> list[str]:
    """The quantized cache write (``dgpp.kernels.quantized_write``) at the release's sizes (bf16 latents of 512 with a
    64-wide k_rot; index keys of 128): its bytes against the torch encoder and scatter on the same rows (padding slots
    included), a row's bytes alone vs in a batch and from a CUDA graph's replay, and its time against that torch
    write (the encoder's ops, then the codes / scales scatters: what the CUDA path ran before)."""
    from dgpp.kernels.kv_write import write_kv_triton
    from dgpp.kernels.latent_formats import quantize_latent
    from dgpp.kernels.quantized_write import write_quantized_ref, write_quantized_triton

    def torch_write(cache, scale, rows, slots, rope_cache, k_rot) -> None:
        stored, row_scale = quantize_latent(rows, "fp4" if cache.dtype == torch.uint8 else "fp8")
        write_kv_triton(scale, scale[..., :0], row_scale, row_scale[..., :0], slots)
        write_kv_triton(cache, rope_cache, stored, k_rot, slots)

    out: list[str] = []
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(3)
    for name, fmt, width, rope_width in (
        ("latent fp8", "fp8", LATENT, ROPE),
        ("latent fp4", "fp4", LATENT, ROPE),
        ("index keys", "fp8", 128, 0),
    ):
        for tokens in (1, 64, 4096):
            scaled = torch.logspace(-3, 3, tokens, device=dev)[:, None, None]
            rows = (torch.randn(tokens, 1, width, generator=g, device=dev) * scaled).to(bf)
            k_rot = torch.randn(tokens, 1, rope_width, generator=g, device=dev).to(bf)
            slots = torch.randperm(8192, generator=g, device=dev)[:tokens]
            slots[3::7] = -1  # padding rows
            got, want, alone = (_write_pools(fmt, width, rope_width) for _ in range(3))
            write_quantized_triton(got[0], got[1], rows, slots, got[2], k_rot)
            write_quantized_ref(want[0], want[1], rows, slots, want[2], k_rot)
            same = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True)
            )
            row = tokens // 2
            write_quantized_triton(
                alone[0], alone[1], rows[row : row + 1], slots[row : row + 1], alone[2], k_rot[row : row + 1]
            )
            solo = int(slots[row]) < 0 or torch.equal(
                alone[0].view(torch.uint8).flatten(0, 1)[slots[row]],
                got[0].view(torch.uint8).flatten(0, 1)[slots[row]],
            )
            captured = _write_pools(fmt, width, rope_width)  # no host read: the write replays from a graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                write_quantized_triton(captured[0], captured[1], rows, slots, captured[2], k_rot)
            graph.replay()
            replayed = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(captured, got, strict=True)
            )
            ours = _timed(write_quantized_triton, *got[:2], rows, slots, got[2], k_rot)
            theirs = _timed(torch_write, *want[:2], rows, slots, want[2], k_rot)
            out.append(
                f"quantized write {name} bf16, {tokens} rows: bytes == torch encoder: "
                f"{'identical' if same else 'DIFFER'}; alone == batched: {'identical' if solo else 'DIFFER'}; "
                f"graph replay == eager: {'identical' if replayed else 'DIFFER'}; "
                f"one launch {ours * 1e6:.1f} us vs torch write {theirs * 1e6:.1f} us"
            )
            if not (same and solo and replayed):
                failures.append(
                    f"quantized write {name} {tokens} rows: same bytes {same}, alone==batched {solo}, "
                    f"graph==eager {replayed}"
                )
    return out


def build_glm5(hf: dict, device: str = "cuda", std: float = 0.02) -> torch.nn.Module:
    """The model of config ``hf`` on ``device`` in its packed form, in the config's dtype (an fp32 config computes in
    fp32): built on meta, packed formats swapped in, then materialised (only packed bytes are ever allocated) and
    filled with random values of the right kind."""
    from dgpp.nn.rotary import RotaryEmbedding, default_inv_freq
    from dgpp.quant.apply import quantize_modules
    from dgpp_glm.glm5 import GlmMoeDsaForCausalLM
    from dgpp_glm.glm5_config import GlmMoeDsaArchConfig
    from dgpp_glm.model import checkpoint_name

    cfg = GlmMoeDsaArchConfig.from_hf_config(hf)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(cfg, dtype=cfg.dtype)
        quantize_modules(model, hf, rename=checkpoint_name)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dtype == torch.int32:
                p.copy_(
                    torch.randint(-(2**31), 2**31 - 1, p.shape, generator=g, device=device, dtype=torch.int32)
                )
            elif p.dtype == torch.int64:  # weight_shape
                continue
            elif "scale" in leaf:
                drawn = torch.rand(p.shape, generator=g, device=device) * 0.002 + 0.001
                if getattr(p, "loaded_itemsize", 0) == 2:  # shipped in BF16, and a loaded model keeps them so
                    p.data = drawn.to(torch.bfloat16)
                else:
                    p.copy_(drawn.to(p.dtype))
            elif p.dim() == 1:
                p.fill_(0.0 if "bias" in leaf else 1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=g, device=device) * std).to(p.dtype))
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):  # to_empty left the buffer unset
                m.inv_freq = default_inv_freq(cfg.rope_theta, m.rotary_dim).to(device)
    from dgpp.startup.weights import settle_weights

    return settle_weights(model).eval()  # the forms a loaded model keeps (MLA's kv_b_proj decoded)


def tiny_fp32_config() -> dict:
    """The tiny glm_moe_dsa config of the exactness checks (index_topk 8: sparse rows live), in fp32."""
    from dgpp_glm.testing_glm5 import tiny_glm_moe_dsa_config

    return {
        **tiny_glm_moe_dsa_config(),
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "torch_dtype": "float32",
    }


def layer_paths(model, prompts: list[list[int]], device: str = "cuda") -> float:
    """Layer 0's attention on one mixed prefill step (sparse rows live), through the CUDA kernels and through the
    torch path on the very same queries and selection: the largest relative difference."""
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.nn.mla_cuda import absorbed_attention_cuda
    from dgpp.offline import make_pools
    from dgpp.policy import overriding

    attn, layer = model.model.layers[0].self_attn, model.model.layers[0]
    pools, blocks, _ = make_pools(model, [len(p) for p in prompts], 4)
    work = [
        SeqWork(i, blocks.allocate(blocks.blocks_for_tokens(len(p))), 0, p) for i, p in enumerate(prompts)
    ]
    batch = build_batch(work, pools, device)
    x = layer.input_layernorm(model.model.embed_tokens(batch.input_ids))
    query = attn.prepare(x, batch)
    selection = attn.indexer(x, query.q_resid, batch)
    kv_b = attn.kv_b_weight().view(attn.num_heads, -1, attn.kv_lora_rank)
    ours = absorbed_attention_cuda(
        query.q_nope, query.q_rot, kv_b, *batch.cache.kv[attn.cache_name], batch, selection, attn.scale
    )
    with overriding(triton_kernels=False):
        torch_out = attn.attend(query, batch, selection)
    return float((attn.o_proj(ours.flatten(1)) - torch_out).abs().max() / torch_out.abs().max())


def exactness_checks(failures: list[str]) -> list[str]:
    """A tiny fp32 glm_moe_dsa (index_topk 8: sparse rows live) on the GPU with the row-invariant policy: layer 0's
    attention through the kernels against the torch path on the same inputs, the whole model on prompts within
    index_topk (no selection to flip at a near-tie) against the torch path, and chunked == one-shot, batched == solo
    bitwise on the kernel path with sparse rows."""
    from dgpp.policy import overriding
    from dgpp.testing import conformance as conf

    model = build_glm5(tiny_fp32_config(), std=0.08)
    prompts = conf.make_prompts(512, (11, 23, 4, 1), seed=2)
    out = []
    with overriding(batch_invariant=True), torch.inference_mode():
        err = layer_paths(model, prompts)
        out.append(
            f"tiny glm_moe_dsa fp32 on CUDA, layer 0 attention (sparse rows) kernels vs torch path: "
            f"rel err {err:.2e}"
        )
        if not err < 1e-4:
            failures.append(f"layer attention kernels vs torch rel err {err}")
        short = conf.make_prompts(512, (8, 5, 3), seed=3)
        ours = conf.engine_all_logits(model, short)
        with overriding(triton_kernels=False):
            ref = conf.engine_all_logits(model, short)
        err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, ref, strict=True))
        out.append(
            f"tiny glm_moe_dsa fp32 on CUDA, whole model, prompts <= index_topk, Triton vs torch path: "
            f"rel err {err:.2e}"
        )
        if not err < 1e-4:
            failures.append(f"tiny model Triton vs torch rel err {err}")
        for what, check in (
            ("chunks 1/5 == one shot", lambda: conf.check_chunk_invariance(model, prompts)),
            ("batched == solo", lambda: conf.check_batch_invariance(model, prompts)),
        ):
            try:
                check()
                out.append(f"tiny glm_moe_dsa on CUDA (sparse rows): {what}: bit-identical")
            except AssertionError as exc:
                out.append(f"tiny glm_moe_dsa on CUDA: {what}: DIFFER ({exc})")
                failures.append(what)
    return out


def decode_bench(
    geometry: str,
    cases: list[tuple[int, int]],
    steps: int,
    bandwidth: float,
    profile: bool = False,
    kv_dtype: str = "auto",
    graphs: tuple[bool, ...] = (False, True),
) -> list[str]:
    from dgpp.bench.models import hf_config
    from dgpp.bench.step_bytes import decode_step_bytes
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.offline import make_pools

    model = build_glm5(hf_config(geometry, torch.bfloat16))
    out = []
    for batch, context in cases:
        # weights (routed experts at their uniform expectation), each layer's latent rows of the tokens it attends
        # (all up to index_topk, then its selection) and every index key once past it, rows as stored
        read = decode_step_bytes(model, batch, context + 1, kv_dtype=kv_dtype)
        total = context + steps + 8
        pools, blocks, slots = make_pools(model, [total] * batch, BS, kv_dtype)
        last: dict[bool, torch.Tensor] = {}
        for graph in graphs:
            tables = [blocks.allocate(blocks.blocks_for_tokens(total)) for _ in range(batch)]
            ids = [slots.allocate() for _ in range(batch)]
            mode = "graph" if graph else "eager"
            try:
                runner = ModelRunner(model, pools, decode_graph=graph, max_batch=batch)
                gen = torch.Generator().manual_seed(batch)
                for t, s in zip(tables, ids, strict=True):
                    runner.step(
                        [SeqWork(s, t, 0, torch.randint(0, 154880, (context,), generator=gen).tolist())]
                    )
                seqs = list(zip(ids, tables, strict=True))
                for i in range(2):  # warm-up (and capture)
                    runner.step([SeqWork(s, t, context + i, [7]) for s, t in seqs])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(steps):
                    logits = runner.step([SeqWork(s, t, context + 2 + i, [7]) for s, t in seqs])
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / steps
                assert torch.isfinite(logits).all()
                last[graph] = logits
                if (
                    profile and (batch, context) == cases[0]
                ):  # both modes: what the graph's step spends and eager's not
                    _profile(runner, seqs, context + 2 + steps)
                name = f"{geometry} kv {kv_dtype} batch {batch} ctx {context} {mode}"
                out.append(rate_line(name, dt, batch, read, bandwidth))
            except Exception as exc:  # report and go on: the table says which case failed
                out.append(
                    f"{geometry} batch {batch} ctx {context} {mode}: FAILED {type(exc).__name__}: "
                    f"{str(exc)[:300]}"
                )
            finally:
                release(blocks, slots, tables, ids)
            print(out[-1], flush=True)
        if len(last) == 2:
            same = torch.equal(last[False], last[True])
            out.append(
                f"{geometry} batch {batch} ctx {context}: last step's logits graph == eager: "
                f"{'bit-identical' if same else 'DIFFER'}"
            )
            print(out[-1], flush=True)
    return out


def _profile(runner, seqs: list, position: int) -> None:
    """Where a decode step's time goes: the top CUDA kernels and CPU ops over three steps from ``position``."""
    from torch.profiler import ProfilerActivity, profile

    from dgpp.engine.work import SeqWork

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            runner.step([SeqWork(slot, table, position + i, [7]) for slot, table in seqs])
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
    print(table.table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="glm-5.3-12l")
    ap.add_argument("--cases", default="1x1024,8x1024,1x8192", help="batch x context, comma-separated")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument(
        "--kv-dtype", default="auto", help="engine.kv_dtype of the decode cases: auto, fp8 or fp4"
    )
    ap.add_argument(
        "--profile", action="store_true", help="profile three decode steps of the first case, eager and graph"
    )
    ap.add_argument(
        "--modes",
        default="eager,graph",
        help="decode modes, comma-separated (a long prompt is prefilled per mode)",
    )
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"eager", "graph"}:
        ap.error(f"--modes: eager and/or graph, comma-separated (got {args.modes!r})")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    bandwidth = copy_bandwidth()
    table = [f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)"]
    failures: list[str] = []
    if not args.skip_kernels:
        table += kernel_checks(failures)
        table += write_checks(failures)
        table += exactness_checks(failures)
        print("\n".join(table), flush=True)
    cases = [tuple(int(n) for n in case.split("x")) for case in args.cases.split(",")]
    graphs = tuple(mode == "graph" for mode in modes)
    table += decode_bench(args.geometry, cases, args.steps, bandwidth, args.profile, args.kv_dtype, graphs)  # type: ignore[arg-type]
    return finish(table, failures)


if __name__ == "__main__":
    sys.exit(main())
