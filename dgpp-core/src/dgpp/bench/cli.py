"""``dgpp bench`` (also ``tests/perf/bench_decode.py``): the decode benchmark on a CUDA machine (not a CI test).

Random weights of a real geometry, a sweep of prompt x batch x generated cases, graph and eager,
against the copy-bandwidth roofline and HF transformers on the same weights:

    dgpp bench --geometry qwen3-8b --cases 128x1x256,128x64x256 --hf-cases 128x1x256

Prints the table (markdown) last; ``--out FILE`` also writes it with the run's date, device and commit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch

from dgpp.bench.args import add_arguments
from dgpp.bench.decode import copy_bandwidth_gbs, format_table, hf_tok_s, run_case
from dgpp.bench.models import build_pair


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    cases = []
    for item in filter(None, text.split(",")):
        prompt, batch, new = (int(x) for x in item.lower().split("x"))
        cases.append((prompt, batch, new))
    return cases


def run(args: argparse.Namespace) -> int:
    device = args.device
    copy_gbs = copy_bandwidth_gbs(device) if device == "cuda" else 1.0
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    model, hf = build_pair(args.geometry, device, torch.bfloat16 if device == "cuda" else torch.float32)
    vocab = model.info.vocab_size
    results, failures = [], []
    for prompt, batch, new in parse_cases(args.check_cases):
        graph = run_case(model, prompt, batch, new, graph=True, copy_gbs=copy_gbs)
        eager = run_case(model, prompt, batch, new, graph=False, copy_gbs=copy_gbs)
        same = graph.tokens == eager.tokens
        print(f"greedy graph == eager for {prompt}x{batch}x{new}: {same}", flush=True)
        if not same:
            failures.append(f"{prompt}x{batch}x{new}")
    hf_cases = set(parse_cases(args.hf_cases))
    gemv_modes = {"on": ("1",), "off": ("0",), "both": ("1", "0")}[args.gemv]
    for prompt, batch, new in parse_cases(args.cases):
        modes = [(g, s) for g in ((True, False) if args.eager else (True,)) for s in gemv_modes]
        for graph, gemv in modes:
            os.environ["DGPP_GEMV"] = gemv
            res = run_case(model, prompt, batch, new, graph=graph, copy_gbs=copy_gbs)
            res.label = f"{'graph' if graph else 'eager'}{'' if gemv == '1' else ', cuBLAS GEMV'}"
            results.append(res)
            print(f"{prompt}x{batch}x{new} {res.label}: {res.ms_per_step:.2f} ms/step "
                  f"(replay {res.replay_ms:.2f}), {res.tok_s:.1f} tok/s, {res.copy_pct:.1f}% of copy bw", flush=True)
        os.environ["DGPP_GEMV"] = gemv_modes[0]
        if (prompt, batch, new) in hf_cases:
            rate = hf_tok_s(hf, prompt, batch, new, vocab)
            for res in results[-len(modes):]:
                res.hf_tok_s = rate
            print(f"{prompt}x{batch}x{new} transformers: {rate:.1f} tok/s", flush=True)
    table = format_table(results, copy_gbs)
    if args.prefill and device == "cuda":
        from dgpp.bench.decode import matmul_peak_tflops, prefill_tflops

        peak = matmul_peak_tflops(device)
        for attn in filter(None, args.prefill_attn.split(",")):
            os.environ["DGPP_PREFILL_ATTN"] = attn
            seconds, rate = prefill_tflops(model, args.prefill)
            table += (f"\n\nprefill of {args.prefill} tokens (batch 1, eager, {attn} attention): {seconds * 1e3:.0f} ms, "
                      f"{rate:.0f} TFLOP/s = {100 * rate / peak:.1f}% of the {peak:.0f} TFLOP/s bf16 matmul rate measured "
                      "in the same run")
            print(table.rsplit("\n", 1)[-1], flush=True)
        os.environ.pop("DGPP_PREFILL_ATTN", None)
    for prompt, batch, _ in parse_cases(args.profile):
        from dgpp.bench.profile import format_breakdown, kernel_breakdown

        for graph in (False, True):
            try:
                per_step, rows = kernel_breakdown(model, batch, prompt, graph=graph)
                label = f"{prompt}x{batch} decode, {'graph replay' if graph else 'eager'}"
                table += "\n\n" + format_breakdown(label, per_step, rows)
            except Exception as e:  # the profiler is optional: keep the table
                table += f"\n\nprofile {prompt}x{batch} graph={graph} failed: {e!r}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = (f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, device "
              f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, commit {commit or 'unknown'}, "
              f"geometry {args.geometry} {model.info.dtype} random weights")
    print("\n" + header + "\n" + table)
    if failures:
        print(f"graph/eager greedy mismatch in: {failures}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgpp bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
