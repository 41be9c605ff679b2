"""End to end with ``engine.prefill_fp8_gemm`` on a tiny FP8 block-scaled Qwen3: the startup log names the lossy
lever, and cold, prefix-hit and concurrent answers through the openai SDK all equal the runner's greedy tokens
with the lever on."""

from __future__ import annotations

import pytest
from served_greedy import QUESTIONS, SERVE_ENGINE, check_served_greedy, served

from dgpp.policy import overriding
from dgpp.quant.checkpoints import quantize_checkpoint
from dgpp.testing.builders import build_tiny_checkpoint

pytestmark = pytest.mark.e2e
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}


def test_fp8_gemm_served_greedy_equals_the_runner_with_the_lever(tmp_path) -> None:
    src = build_tiny_checkpoint("qwen3", tmp_path / "src", seed=21)
    ckpt = quantize_checkpoint(src, tmp_path / "ckpt", FP8)
    with served(ckpt, tmp_path, engine={**SERVE_ENGINE, "prefill_fp8_gemm": True}) as (server, sdk):
        with overriding(prefill_fp8_gemm=True):  # the runner's greedy tokens with the lever on
            check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=16)
        log = server.log.read_text()
    assert "lossy lever on" in log and "engine.prefill_fp8_gemm" in log
