"""``dgpp bench`` (also ``tests/perf/bench_decode.py``): the decode benchmark on a CUDA machine (not a CI test).

Random weights of a real geometry, a sweep of prompt x batch x generated cases, graph and eager,
against the copy-bandwidth roofline and HF transformers on the same weights:

    dgpp bench --geometry qwen3-8b --cases 128x1x256,128x64x256 --hf-cases 128x1x256
    dgpp bench --quant bf16,fp8_block,nvfp4 ...   # the same sweep per weight format, one table
    dgpp bench --kv-dtype auto,fp8 ...            # the same sweep per K/V cache format (engine.kv_dtype)
    dgpp bench serve --serve-cases 1,8,64         # a real dgpp serve over HTTP (dgpp/bench/serve.py)
    dgpp bench verify --verify-depths 1,3         # the speculative verify path, oracle and null drafters

``--quant`` encodes every decoder-layer linear and routed expert of the random bf16 model on the device
(dgpp/bench/quantize.py) and serves it through the packed modules a loaded checkpoint gets; transformers runs the
decoded values. ``EXPERTS+LINEARS`` mixes formats as MoE releases do:

    dgpp bench --geometry deepseek-v4-flash-8l@4 --quant mxfp4+fp8_block   # MXFP4 experts, FP8 block linears
``--kv-dtype`` stores the cache as ``engine.kv_dtype`` would (fp8: e4m3 rows with fp32 row scales; fp4: packed MLA
latents) and counts bytes/step with the rows as stored; a format the geometry's attention does not read is that
case's row ("refused: ..."). Long prompts are prefilled in steps of the engine's tick budget (8192 rows).

Prints the table (markdown) last; ``--out FILE`` also writes it with the run's date, device and commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import sys
import time
import traceback

import torch

from dgpp.bench.args import add_arguments, parse_cases
from dgpp.bench.decode import DecodeResult, copy_bandwidth_gbs, format_table, hf_tok_s, run_case
from dgpp.bench.models import build_pair, hf_config, packed_release, weight_bytes_per_step
from dgpp.bench.provenance import tree_commit
from dgpp.bench.quantize import (
    DENSE,
    compare_with_torch_path,
    parse_variants,
    quantize_model,
    quantized_linears,
    shares_storage,
    sync_hf_weights,
)
from dgpp.bench.step_bytes import packed_experts
from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError
from dgpp.policy import current, install, overriding
from dgpp.startup.kv_format import refuse_unstored_kv
from dgpp.step.cache_spec import stored_as
from dgpp.step.model import Model

# kernels and the torch path round differently (bf16 weights vs fp32 products, split-K order), so a packed
# module's output differs by rounding (~1e-2); a layout or scale bug moves it by its own size
GROSS_MISMATCH = 0.25


# --gemv modes -> the label a timed case gets ("0" takes the caller's cuBLAS / wo_matmul label)
GEMV_LABELS = {"1": "", "row": ", row GEMV", "mma": ", MMA GEMV"}


def _set_gemv(mode: str, rows: int = 1) -> None:
    """Dense decode GEMV on unless mode "0"; packed layers: "1" (the engine's default: ``auto`` for an engine whose
    steps hold ``rows`` decode rows, as ``dgpp serve`` resolves it), "0" (wo_matmul), "row"/"mma"."""
    install(
        dataclasses.replace(
            current(),
            dense_gemv=mode != "0",
            packed_decode_gemv=mode != "0",
            quant_decode_gemv=mode if mode in ("row", "mma") else "auto",
            decode_max_rows=rows,
        )
    )


def bench_weights(
    model: Model,
    hf: torch.nn.Module | None,
    args: argparse.Namespace,
    copy_gbs: float,
    tag: str,
    kv_dtype: str = "auto",
    hf_rates: dict[tuple[int, int, int], float] | None = None,
) -> tuple[list, list[str], list[str]]:
    """Every check, case, prefill and profile of one weight variant with the cache stored as ``kv_dtype``:
    (results, table sections, failures). ``tag`` (the format under ``--quant``, the kv dtype under ``--kv-dtype``)
    starts each row's mode and each section's title; ``hf`` None: no transformers column (it lacks the model type,
    or it does not hold this variant's weights); ``hf_rates``: transformers' rates already measured on these
    weights, by case (its cache is its own whatever ``kv_dtype``). A ``kv_dtype`` the model does not store is
    every case's result ("refused", the reason in a section)."""
    refused = kv_refusal(model, kv_dtype)
    if refused:
        print(f"{tag}refused: {refused}", flush=True)
        rows = [_refused_row(case, tag, refused) for case in parse_cases(args.cases)]
        return rows, [f"{tag}refused: {refused}"], []
    hf_rates = {} if hf_rates is None else hf_rates
    device, vocab = args.device, model.info.vocab_size
    results, sections, failures = [], [], []
    if not getattr(model, "decode_graph_safe", True):  # the runner captures no graphs for it
        sections.append(
            f"{tag}{type(model).__name__} decodes eager (its decode step is not CUDA-graph safe): the 'graph' rows "
            "and the graph == eager checks run eager steps"
        )
        print(sections[-1], flush=True)
    for prompt, batch, new in parse_cases(args.check_cases):
        graph = run_case(model, prompt, batch, new, graph=True, copy_gbs=copy_gbs, kv_dtype=kv_dtype)
        eager = run_case(model, prompt, batch, new, graph=False, copy_gbs=copy_gbs, kv_dtype=kv_dtype)
        same = graph.tokens == eager.tokens
        print(f"{tag}greedy graph == eager for {prompt}x{batch}x{new}: {same}", flush=True)
        if not same:
            failures.append(f"{tag}{prompt}x{batch}x{new}")
    hf_cases = set(parse_cases(args.hf_cases))
    gemv_modes = {
        "on": ("1",),
        "off": ("0",),
        "both": ("1", "0"),
        "mma": ("mma",),
        "row+mma": ("row", "mma"),
    }[args.gemv]
    # --gemv off: dense layers go to cuBLAS, packed ones to the generic weight-only kernel (wo_matmul)
    off_label = ", wo_matmul" if quantized_linears(model) else ", cuBLAS GEMV"
    for prompt, batch, new in parse_cases(args.cases):
        modes = [(g, s) for g in ((True, False) if args.eager else (True,)) for s in gemv_modes]
        for graph, gemv in modes:
            _set_gemv(gemv, batch)
            res = run_case(model, prompt, batch, new, graph=graph, copy_gbs=copy_gbs, kv_dtype=kv_dtype)
            res.label = f"{tag}{'graph' if graph else 'eager'}{GEMV_LABELS.get(gemv, off_label)}"
            results.append(res)
            release_device_memory(device)
            print(
                f"{prompt}x{batch}x{new} {res.label}: {res.ms_per_step:.2f} ms/step (replay {res.replay_ms:.2f}), "
                f"{res.tok_s:.1f} tok/s, {res.step_bytes / 1e9:.3f} GB/step, {res.copy_pct:.1f}% of copy bw",
                flush=True,
            )
        _set_gemv(gemv_modes[0])
        if hf is not None and (prompt, batch, new) in hf_cases:
            case = (prompt, batch, new)
            if case not in hf_rates:  # transformers' own cache: one rate for every kv dtype
                hf_rates[case] = hf_tok_s(hf, prompt, batch, new, vocab)
                print(f"{prompt}x{batch}x{new} {tag}transformers: {hf_rates[case]:.1f} tok/s", flush=True)
            for res in results[-len(modes) :]:
                res.hf_tok_s = hf_rates[case]
    if args.prefill and device == "cuda":
        from dgpp.bench.decode import matmul_peak_tflops, prefill_tflops

        peak = matmul_peak_tflops(device)
        for attn in filter(None, args.prefill_attn.split(",")):
            with overriding(prefill_attention=attn):
                seconds, rate, with_attention = prefill_tflops(model, args.prefill, kv_dtype=kv_dtype)
            counted = "" if with_attention else ", matrices only"
            sections.append(
                f"{tag}prefill of {args.prefill} tokens (batch 1, eager, {attn} attention): {seconds * 1e3:.0f} ms, "
                f"{rate:.0f} TFLOP/s{counted} = {100 * rate / peak:.1f}% of the {peak:.0f} TFLOP/s bf16 matmul "
                "rate measured in the same run"
            )
            print(sections[-1], flush=True)
            if args.profile_prefill:
                from dgpp.bench.profile import format_breakdown, prefill_breakdown

                with overriding(prefill_attention=attn):
                    per_prefill, rows = prefill_breakdown(model, args.prefill, kv_dtype=kv_dtype)
                label = f"{tag}prefill of {args.prefill} tokens, {attn} attention"
                sections.append(format_breakdown(label, per_prefill, rows, per=""))
                print(sections[-1], flush=True)
    for prompt, batch, _ in parse_cases(args.profile):
        from dgpp.bench.profile import format_breakdown, kernel_breakdown

        _set_gemv(gemv_modes[0], batch)  # the policy the case itself ran under (packed: row or MMA by rows)
        for graph in (False, True):
            try:
                per_step, rows = kernel_breakdown(model, batch, prompt, graph=graph, kv_dtype=kv_dtype)
                label = f"{tag}{prompt}x{batch} decode, {'graph replay' if graph else 'eager'}"
                sections.append(format_breakdown(label, per_step, rows))
            except Exception as e:  # the profiler is optional: keep the table
                sections.append(f"{tag}profile {prompt}x{batch} graph={graph} failed: {e!r}")
        _set_gemv(gemv_modes[0])
    return results, sections, failures


def release_device_memory(device: str) -> None:
    """Hand the cached blocks of finished sessions back to the device (a session's graphs hold its pools until
    collected): a 32K-context case's pools are tens of GB."""
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def kv_refusal(model: Model, kv_dtype: str) -> str:
    """Why the engine would refuse ``engine.kv_dtype: kv_dtype`` for ``model`` ("" when it stores it)."""
    try:
        refuse_unstored_kv(EngineConfig(kv_dtype=kv_dtype), model.info.dtype)  # type: ignore[arg-type]
        stored_as(model.cache_spec(), kv_dtype)
    except ConfigError as e:
        return str(e)
    return ""


def _refused_row(case: tuple[int, int, int], tag: str, reason: str) -> DecodeResult:
    prompt, batch, new = case
    return DecodeResult(prompt, batch, new, graph=True, label=f"{tag}graph", refused=reason)


def parse_kv_dtypes(text: str) -> list[str]:
    """``--kv-dtype``'s formats in order, each once ("" is the engine's default, ``auto``); an unknown one is an
    error naming the flag."""
    known = ("auto", "bf16", "fp8", "fp4")  # engine.kv_dtype's values
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip())) or ["auto"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--kv-dtype: unknown format(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def bench_kv_dtypes(
    model: Model,
    hf: torch.nn.Module | None,
    args: argparse.Namespace,
    copy_gbs: float,
    tag: str,
) -> tuple[list, list[str], list[str]]:
    """:func:`bench_weights` once per ``--kv-dtype`` format, each format's rows tagged ``kv FORMAT`` when the flag
    is given; one format's failure keeps the others' numbers, transformers' rates are measured once."""
    results, sections, failures = [], [], []
    hf_rates: dict[tuple[int, int, int], float] = {}
    flag = getattr(args, "kv_dtype", "")
    for kv_dtype in parse_kv_dtypes(flag):
        kv_tag = f"{tag}kv {kv_dtype} " if flag else tag
        try:
            found, extra, failed = bench_weights(model, hf, args, copy_gbs, kv_tag, kv_dtype, hf_rates)
        except Exception as e:  # GPU time is scarce: keep the other formats' numbers
            traceback.print_exc()
            found, extra, failed = [], [f"{kv_tag}failed: {e!r}"], [f"{kv_tag}raised {e!r}"]
        results += found
        sections += extra
        failures += failed
        release_device_memory(args.device)  # the next format's pools take this one's room
    return results, sections, failures


def prepare_variant(
    dense: Model,
    args: argparse.Namespace,
    dtype: torch.dtype,
    variant: str,
    sections: list[str],
    failures: list[str],
) -> Model:
    """``dense`` encoded in ``variant``, its bytes printed and its kernels checked against the torch path."""
    t0 = time.perf_counter()
    model = quantize_model(dense, hf_config(args.geometry, dtype), variant, packed_release(args.geometry))
    print(
        f"{variant}: decoder-layer linears and routed experts encoded on {args.device} in "
        f"{time.perf_counter() - t0:.1f} s, "
        f"weights read per step {weight_bytes_per_step(model)} bytes (dense: {weight_bytes_per_step(dense)})",
        flush=True,
    )
    check = compare_with_torch_path(model)
    sections.append(
        f"{variant}: kernels vs the torch decode path (4 random 32-token prompts): max |diff| / max "
        f"|logit| {check['prefill_rel_diff']:.2e} prefill, {check['decode_rel_diff']:.2e} decode step; "
        f"argmax agreement {check['prefill_argmax_agree']:.0%} / {check['decode_argmax_agree']:.0%}; "
        f"worst packed module on the same inputs {check['module_rel_diff']:.2e} ({check['module_worst'] or '-'})"
    )
    print(sections[-1], flush=True)
    # a random MoE model's logits amplify rounding (a flipped expert): with packed experts the modules' own errors
    # decide; without, the logits do as well
    logits_diff = 0.0 if packed_experts(model) else max(check["prefill_rel_diff"], check["decode_rel_diff"])
    if max(check["module_rel_diff"], logits_diff) > GROSS_MISMATCH:
        failures.append(f"{variant} kernels vs torch path")
    return model


def run(args: argparse.Namespace) -> int:
    if getattr(args, "mode", "decode") == "serve":
        from dgpp.bench.serve import run_serve

        return run_serve(args)
    if getattr(args, "mode", "decode") == "verify":
        from dgpp.bench.verify import run_verify

        return run_verify(args)
    if getattr(args, "mode", "decode") == "kv-quality":
        from dgpp.bench.kv_quality import run_kv_quality

        return run_kv_quality(args)
    if getattr(args, "mode", "decode") == "prefill-levers":
        from dgpp.bench.prefill_levers import run_prefill_levers

        return run_prefill_levers(args)
    device = args.device
    quant = getattr(args, "quant", "")
    variants = parse_variants(quant)
    kv_flag = getattr(args, "kv_dtype", "")
    kv_dtypes = parse_kv_dtypes(kv_flag)  # a typo fails before the model is built
    copy_gbs = copy_bandwidth_gbs(device) if device == "cuda" else 1.0
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # no transformers model when no case asks for it (a 122B-shaped MoE has room for one copy only)
    dense, hf = build_pair(args.geometry, device, dtype, with_hf=bool(parse_cases(args.hf_cases)))
    dense_name = "bf16" if dtype == torch.bfloat16 else "fp32"
    results, sections, failures = [], [], []
    hf_holds, wants_hf = DENSE, hf is not None and bool(parse_cases(args.hf_cases))
    if wants_hf and len(variants) > 1 and shares_storage(dense, hf):
        # decoded weights written into transformers would overwrite the dense source every format is encoded from
        print(
            "transformers shares dgpp's tensors (no room for two copies): no HF column for quantized formats"
        )
        wants_hf = False
    for variant in variants:
        tag = f"{dense_name if variant == DENSE else variant} " if quant else ""
        try:
            model = (
                dense
                if variant == DENSE
                else prepare_variant(dense, args, dtype, variant, sections, failures)
            )
            if wants_hf and hf_holds != variant:  # transformers runs the values this variant decodes to
                sync_hf_weights(hf, model)
                hf_holds = variant
            found, extra, failed = bench_kv_dtypes(
                model, hf if hf_holds == variant else None, args, copy_gbs, tag
            )
        except Exception as e:  # one format's failure must not lose the others' numbers (GPU time is scarce)
            traceback.print_exc()
            failures.append(f"{tag}raised {e!r}")
            found, extra, failed = [], [f"{tag}failed: {e!r}"], []
        results += found
        sections += extra
        failures += failed
        model = None
        release_device_memory(device)  # the next format's copy takes this one's room
    table = "\n\n".join([format_table(results, copy_gbs), *sections])
    commit = tree_commit()
    weights = (
        f"weights {', '.join(dense_name if v == DENSE else v for v in variants)} (quantized: the decoder-layer "
        f"linears and routed experts the geometry's releases pack; embedding, lm_head and norms {dense_name}; "
        "transformers runs the decoded values)"
    )
    header = (
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, device "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, commit {commit or 'unknown'}, "
        f"geometry {args.geometry} {dense.info.dtype} random weights"
        + (f", {weights}" if quant else "")
        + (
            f", K/V cache {', '.join(kv_dtypes)} (engine.kv_dtype; bytes/step count the rows as stored)"
            if kv_flag
            else ""
        )
    )
    print("\n" + header + "\n" + table)
    if failures:
        print(f"failed checks (graph/eager greedy, kernels vs torch path, errors): {failures}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    from dgpp.demo import enable_demo_checkpoints

    enable_demo_checkpoints()  # the served checkpoint goes through checkpoint resolution like dgpp serve's
    parser = argparse.ArgumentParser(
        prog="dgpp bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
