"""``dgpp bench prefill-levers``: what ``engine.prefill_fp8_gemm`` and ``engine.prefill_bf16_partials`` cost, on the CPU.

    dgpp bench prefill-levers [--model dgpp-demo/smollm2-135m-instruct] [--dtype float32] [--runs 3]
                              [--new-tokens 32] [--fixtures] [--out FILE]

The fp8 GEMM acts on FP8 block-scaled linears, so the real model (default: the demo's SmolLM2-135M-Instruct) is
loaded with ``engine.dense_weights: fp8`` (its dense stack encoded to 128 x 128 E4M3 blocks at load), and that is
the chain the lever is scored against, over ``dgpp.bench.kv_quality_texts`` exactly as ``dgpp bench kv-quality``
scores fp8 K/V: mean NLL per token and argmax agreement teacher-forced, greedy tokens kept, against the run-to-run
band of the lever-off chain (its runs and a chunked run). Neither SmolLM2 nor any dense checkpoint has packed
experts, so ``--fixtures`` reports, for each lever, the largest and mean logit error against the lever-off chain
on tiny fp32 checkpoints that carry what it acts on: FP8 block-scaled Qwen3 (blocks of 32) for the fp8 GEMM,
NVFP4-expert Qwen3-MoE and Qwen3.5-MoE for the bf16 partials.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dgpp.bench.kv_quality import FIXTURE_LENGTHS, LossyChain, load_scored, measure_model, print_report
from dgpp.config_schema import EngineConfig
from dgpp.offline import engine_all_logits, make_prompts
from dgpp.policy import overriding

FP8_GEMM = LossyChain("prefill_fp8_gemm", policy=(("prefill_fp8_gemm", True),))
FP8_BLOCKS = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
}
NVFP4_EXPERTS = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "group_size": 16,
    "exclude_modules": ["lm_head", "*self_attn*", "*linear_attn*", "*shared_expert*", "*mlp.gate"],
}
# (lever, tiny checkpoint kind, quantization config the checkpoint is written in)
FIXTURES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("prefill_fp8_gemm", "qwen3", FP8_BLOCKS),
    ("prefill_bf16_partials", "qwen3_moe", NVFP4_EXPERTS),
    ("prefill_bf16_partials", "qwen3_5_moe", NVFP4_EXPERTS),
)


def fixture_errors() -> Iterator[str]:
    """Per lever and packed tiny checkpoint (fp32): the lever's logit error against the lever-off chain."""
    from dgpp.catalog import tiny_checkpoint
    from dgpp.quant.checkpoints import quantize_checkpoint
    from dgpp.startup.loading import load_model

    yield "| lever | tiny checkpoint | largest abs Δ logit / largest abs logit | mean abs Δ logit / largest abs logit |"
    yield "|---|---|---|---|"
    for lever, kind, config in FIXTURES:
        with tempfile.TemporaryDirectory() as tmp:
            src = tiny_checkpoint(kind).build(Path(tmp) / "src", seed=0)
            model = load_model(quantize_checkpoint(src, Path(tmp) / "q", config))
            prompts = make_prompts(model.info.vocab_size, FIXTURE_LENGTHS, seed=2)
            exact = torch.cat(engine_all_logits(model, prompts))
            with overriding(**{lever: True}):
                lossy = torch.cat(engine_all_logits(model, prompts))
        scale = float(exact.abs().max())
        diff = (lossy - exact).abs()
        yield (
            f"| {lever} | {kind} ({config['quant_method']}) | {float(diff.max()) / scale:.2e} "
            f"| {float(diff.mean()) / scale:.2e} |"
        )


def _sections(args: argparse.Namespace) -> Iterator[str]:
    if args.model:
        model, texts = load_scored(args.model, args.dtype, EngineConfig(dense_weights="fp8"))
        yield (
            f"## engine.prefill_fp8_gemm on {args.model} ({args.dtype}, engine.dense_weights fp8), {len(texts)} "
            f"texts, {sum(len(t) for t in texts)} tokens"
        )
        yield ""
        yield from measure_model(model, texts, args.runs, args.new_tokens, (FP8_GEMM,), base="lever off")
    if args.fixtures:
        yield from [
            "",
            "## prefill lever logit error against the lever-off chain, packed tiny fp32 checkpoints",
            "",
        ]
        yield from fixture_errors()


def run_prefill_levers(args: argparse.Namespace) -> int:
    return print_report(_sections(args), args.out)
