"""The flags of ``dgpp bench`` (kept free of torch so the ``dgpp`` command starts fast)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mode",
        nargs="?",
        choices=("decode", "serve", "verify", "kv-quality", "prefill-levers"),
        default="decode",
        help="decode: the in-process decode sweep; serve: a real dgpp serve driven over HTTP; verify: the "
        "speculative verify path with an oracle (always right) and a null (never right) drafter; kv-quality: "
        "engine.kv_dtype fp8 against the exact chain (NLL, greedy agreement, the exact chain's band); "
        "prefill-levers: engine.prefill_fp8_gemm and engine.prefill_bf16_partials against the lever-off chain "
        "(the kv-quality flags)",
    )
    parser.add_argument(
        "--geometry", default="qwen3-8b", help="a bench geometry; NAME@N keeps its first N decoder layers"
    )
    parser.add_argument("--cases", default="128x1x256,128x64x256", help="promptxbatchxnew, comma separated")
    parser.add_argument(
        "--hf-cases", default="128x1x256", help="cases also run through transformers generate"
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="also time each case without graphs (verify mode: every run's steps eager, beside the graph runs)",
    )
    parser.add_argument(
        "--check-cases", default="128x4x64", help="cases whose graph and eager greedy tokens must agree"
    )
    parser.add_argument("--profile", default="", help="cases whose per-kernel GPU time is broken down")
    parser.add_argument(
        "--gemv",
        choices=("on", "off", "both", "mma", "row+mma"),
        default="on",
        help="decode GEMV kernels (DGPP_GEMV; packed weights: DGPP_QUANT_GEMV) for the timed cases; "
        "both = each case twice; mma / row+mma: packed layers on the MMA GEMV (and the row GEMV)",
    )
    parser.add_argument(
        "--prefill", type=int, default=0, help="also time one eager prefill of this many tokens"
    )
    parser.add_argument(
        "--profile-prefill",
        action="store_true",
        help="with --prefill: where the prefill's GPU time goes, per kernel (each --prefill-attn path)",
    )
    parser.add_argument(
        "--prefill-attn",
        default="torch",
        help="prefill attention paths to time, comma separated: torch, triton (DGPP_PREFILL_ATTN)",
    )
    parser.add_argument(
        "--quant",
        default="",
        help="weight formats to benchmark in turn, comma separated: bf16 (the dense model), fp8_block, "
        "fp8_channel, nvfp4, mxfp4 (decoder-layer linears and routed experts encoded on the device, except "
        "the modules the geometry's releases keep dense), or EXPERTS+LINEARS: routed experts in one format, "
        "the other decoder-layer linears in another or bf16 (mxfp4+fp8_block as DeepSeek-V4-Flash and "
        "MiMo-V2.6-Flash ship; nvfp4+bf16), or release (the quantization_config the geometry's release ships: "
        "Flint's FP8/NVFP4 experts per layer and projection); serve mode: one single format, the checkpoint "
        "written packed in that release's layout (dense geometries)",
    )
    parser.add_argument(
        "--kv-dtype",
        default="",
        help="K/V cache formats to benchmark in turn, comma separated (engine.kv_dtype): auto (the compute "
        "dtype), bf16, fp8 (e4m3 rows with fp32 row scales; MLA latents too), fp4 (packed MLA latents); each "
        "row's mode starts 'kv FORMAT' and bytes/step count the cache as stored; a format the geometry's "
        "attention does not read shows as 'refused' (empty: auto, rows untagged)",
    )
    parser.add_argument("--out", default="")
    parser.add_argument("--device", default="cuda", help="cpu only smoke-tests the script (tiny geometry)")
    serve = parser.add_argument_group("serve mode (dgpp bench serve)")
    serve.add_argument(
        "--serve-cases",
        default="1,8,16,32,64,64:sampled,64:nostream",
        help="N[:sampled][:nostream], comma separated: N clients at once",
    )
    serve.add_argument("--prompt-tokens", type=int, default=128)
    serve.add_argument("--max-tokens", type=int, default=256)
    serve.add_argument("--engine", default="", help="engine keys (JSON object) over the bench's own")
    serve.add_argument("--checkpoint-dir", default="", help="where the random checkpoint is written (reused)")
    serve.add_argument("--server-pythonpath", default="", help="PYTHONPATH prepended for the server process")
    serve.add_argument(
        "--profile-dir", default="", help="py-spy profiles of the server during streaming cases"
    )
    serve.add_argument(
        "--profile-delay",
        type=float,
        default=2.0,
        help="seconds after a case's requests are sent before the profile starts (0: the burst itself)",
    )
    serve.add_argument("--no-bench", action="store_true", help="skip the in-process decode rates")
    serve.add_argument(
        "--solo-check",
        type=int,
        default=0,
        help="N greedy prompts sent one at a time, then all N at once: their texts must be equal (exit 1 if not)",
    )
    quality = parser.add_argument_group("kv-quality and prefill-levers modes")
    quality.add_argument(
        "--model", default="dgpp-demo/smollm2-135m-instruct", help="the checkpoint scored ('' for none)"
    )
    quality.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    quality.add_argument("--runs", type=int, default=3, help="exact-chain runs that make the run-to-run band")
    quality.add_argument("--new-tokens", type=int, default=32, help="greedy tokens continued from each text")
    quality.add_argument(
        "--fixtures",
        action="store_true",
        help="also each (packed) tiny checkpoint's logit error under the lever",
    )
    quality.add_argument(
        "--geometries", action="store_true", help="also K/V bytes with and without fp8 per bench geometry"
    )
    verify = parser.add_argument_group("verify mode (dgpp bench verify)")
    verify.add_argument("--verify-depths", default="1,3", help="drafts per pass, comma separated")
    verify.add_argument(
        "--verify-drafters", default="oracle,null", help="scripted drafters, comma separated: oracle, null"
    )
    verify.add_argument(
        "--schedule",
        choices=("off", "on", "both"),
        default="off",
        help="run the drafters without / with engine.mtp_schedule (its default settings), or both",
    )


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``PROMPTxBATCHxNEW`` cases, comma separated."""
    cases = []
    for item in filter(None, text.split(",")):
        prompt, batch, new = (int(x) for x in item.lower().split("x"))
        cases.append((prompt, batch, new))
    return cases
