"""``engine.prefill_bf16_partials``: each prefill row's weighted expert partial rounded to bf16 before the fp32
per-token sum, in the packed experts' torch path and their fused kernel (Triton interpreter, fp32), and on a tiny
NVFP4-expert Qwen3-MoE checkpoint: a nonzero, bounded move of the logits, chunked == one-shot and batched == solo
with the lever on, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dgpp.policy import overriding
from dgpp.quant.fp4 import NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import IntPacked
from dgpp.quant.kernels.moe_launch import fused_quant_moe
from dgpp.quant.kernels.operands import interpreting
from dgpp.quant.moe import QuantExperts
from dgpp.startup.loading import load_model
from dgpp.step.prefill_rows import ALL_ROWS
from dgpp.testing import conformance as conf
from dgpp.testing.levers import check_lever_exactness, lever_row_errors

from .test_quant_moe_fused import HIDDEN, NVFP4_EXPERTS_ONLY, build_experts, routing

LEVER = "prefill_bf16_partials"

FORMATS = [NVFP4ModelOpt(), IntPacked(bits=4, group=64), FP8Block(block=(32, 32))]


def _reference_with_bf16_partials(moe: QuantExperts, x, weights, ids) -> torch.Tensor:
    """The formula written out: fp32 partials per (token, slot), each rounded to bf16, summed in fp32."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gate = x[t : t + 1] @ moe.expert_weight("gate_proj", e, torch.float32).T
            up = x[t : t + 1] @ moe.expert_weight("up_proj", e, torch.float32).T
            y = (torch.nn.functional.silu(gate) * up) @ moe.expert_weight("down_proj", e, torch.float32).T
            out[t] += (y[0] * weights[t, s]).to(torch.bfloat16).float()
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_torch_path_rounds_each_partial_to_bf16(fmt):
    moe = build_experts(fmt, seed=3)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(6, 3, seed=5)
    exact = moe(x, weights, ids)
    with overriding(prefill_bf16_partials=True):
        lossy = moe(x, weights, ids)
    want = _reference_with_bf16_partials(moe, x, weights, ids)
    scale = float(exact.abs().max())
    assert float((lossy - want).abs().max()) <= 1e-5 * scale
    moved = float((lossy - exact).abs().max()) / scale
    assert 0 < moved < 2**-7, moved  # at most a few bf16 half-ulps of the partials, never zero


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fused_kernel_with_bf16_partials_equals_the_torch_path(fmt):
    if not interpreting():
        pytest.skip("the fused kernel runs on CPU tensors under TRITON_INTERPRET=1 only")
    moe = build_experts(fmt, seed=6)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(7))
    weights, ids = routing(40, 2, seed=8)
    want = moe.forward_reference(x, weights, ids, ALL_ROWS)
    exact = moe.forward_reference(x, weights, ids)
    moe.use_fused = True
    try:
        with overriding(prefill_bf16_partials=True):
            got = moe(x, weights, ids)
    finally:
        moe.use_fused = None
    scale = float(want.abs().max())
    # the kernel's fp32 partials sum K in another order than the torch path: where one lands on a bf16 rounding
    # boundary the two round it one bf16 step apart; everywhere else they agree to the bit
    assert float((got - want).abs().max()) <= 2**-8 * scale
    assert float((got == want).float().mean()) > 0.99
    assert float((got - exact).abs().max()) > 1e-7 * scale


def test_a_mixed_step_rounds_only_its_prefill_rows():
    """``bf16_partial_rows`` as row indices (a step with decode rows beside a prefill chunk): those rows equal the
    all-rows result, the others the exact one, bit for bit."""
    if not interpreting():
        pytest.skip("the fused kernel runs on CPU tensors under TRITON_INTERPRET=1 only")
    moe = build_experts(NVFP4ModelOpt(), seed=9)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(10))
    weights, ids = routing(12, 2, seed=11)
    gate_up = (moe.gate_proj.fmt, moe.gate_proj.stacks(), moe.up_proj.stacks())
    down = (moe.down_proj.fmt, moe.down_proj.stacks())
    args = (gate_up, down, x, weights, ids, moe.inter)
    exact = fused_quant_moe(*args)
    every = fused_quant_moe(*args, bf16_partial_rows=ALL_ROWS)
    rows = torch.tensor([2, 3, 4, 5, 6, 7, 8])
    mixed = fused_quant_moe(*args, bf16_partial_rows=rows)
    others = torch.tensor([0, 1, 9, 10, 11])
    assert torch.equal(mixed[rows], every[rows]) and torch.equal(mixed[others], exact[others])
    assert not torch.equal(every[rows], exact[rows])


@pytest.fixture(scope="module")
def nvfp4_moe(tmp_path_factory):
    from dgpp.quant.checkpoints import quantize_checkpoint
    from dgpp.testing.builders import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("bf16_partials")
    src = build_tiny_checkpoint("qwen3_moe", root / "src", seed=12)
    return load_model(quantize_checkpoint(src, root / "q", NVFP4_EXPERTS_ONLY))


def test_the_lever_moves_moe_logits_by_a_bounded_nonzero_amount(nvfp4_moe):
    rel = lever_row_errors(nvfp4_moe, conf.make_prompts(nvfp4_moe.info.vocab_size, (7, 19, 1), seed=1), LEVER)
    assert bool((rel > 0).all()), "a row the lever should have moved kept the exact bits"
    # a bf16 half-ulp per partial moves most rows by 1e-3; a router at a near-tie (random weights) may then pick
    # another expert in a later layer, which moves that row as a whole
    assert float((rel < 0.01).float().mean()) >= 0.9 and float(rel.max()) < 0.5, rel


def test_bf16_partial_rows_are_the_same_chunked_or_batched(nvfp4_moe):
    check_lever_exactness(nvfp4_moe, conf.make_prompts(nvfp4_moe.info.vocab_size, (7, 19, 4), seed=2), LEVER)
