"""End to end with each prefill lever on a tiny checkpoint it acts on: ``engine.prefill_fp8_gemm`` on an FP8
block-scaled Qwen3, ``engine.prefill_bf16_partials`` on an NVFP4-expert Qwen3-MoE. The startup log names the lossy
lever, and cold, prefix-hit and concurrent answers through the openai SDK all equal the runner's greedy tokens
with the lever on."""

from __future__ import annotations

import pytest
from served_greedy import QUESTIONS, SERVE_ENGINE, check_served_greedy, served

from dgpp.bench.prefill_levers import FP8_BLOCKS, NVFP4_EXPERTS
from dgpp.policy import overriding
from dgpp.quant.checkpoints import quantize_checkpoint
from dgpp.testing.builders import build_tiny_checkpoint

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "lever,kind,config",
    [("prefill_fp8_gemm", "qwen3", FP8_BLOCKS), ("prefill_bf16_partials", "qwen3_moe", NVFP4_EXPERTS)],
)
def test_served_greedy_equals_the_runner_with_the_lever(tmp_path, lever, kind, config) -> None:
    ckpt = quantize_checkpoint(
        build_tiny_checkpoint(kind, tmp_path / "src", seed=21), tmp_path / "ckpt", config
    )
    with served(ckpt, tmp_path, engine={**SERVE_ENGINE, lever: True}) as (server, sdk):
        with overriding(**{lever: True}):  # the runner's greedy tokens with the lever on
            check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=16)
        log = server.log.read_text()
    assert "lossy lever on" in log and f"engine.{lever}" in log
