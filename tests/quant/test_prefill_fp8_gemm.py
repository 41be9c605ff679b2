"""``engine.prefill_fp8_gemm``: per-token e4m3 activations against E4M3 block-scaled weights, checked against the
exact sum of the quantized inputs (torch path), the Triton kernel under the interpreter (fp32) against the torch
path, and on a tiny FP8 Qwen3 checkpoint: a nonzero, bounded move of the logits, chunked == one-shot and
batched == solo with the lever on, and the rows outside a lever's reach left bit for bit."""

from __future__ import annotations

import pytest
import torch

from dgpp.bench.prefill_levers import FP8_BLOCKS
from dgpp.policy import overriding
from dgpp.quant.checkpoints import quantize_checkpoint
from dgpp.quant.encode import encode
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.fp8_prefill import (
    E4M3_MAX,
    fp8_gemm_reference,
    fp8_linear,
    fp8_prefill_matmul,
    quantize_activations,
    weight_operands,
)
from dgpp.quant.linear import packed_matmul
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.levers import check_lever_exactness, lever_row_errors

LEVER = "prefill_fp8_gemm"


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, 3] = 40.0  # an outlier: its group's scale follows it
    x[1, : min(k, 128)] = 0.0  # all-zero groups
    return x


def _weight(fmt: FP8Block, n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    return fmt.prepare(encode(fmt, w), (n, k))


@pytest.mark.parametrize("k,group", [(256, 128), (200, 128), (96, 32)])
def test_activation_codes_are_e4m3_of_x_over_its_group_scale(k, group):
    x = _activations(5, k, seed=1)
    codes, scales = quantize_activations(x, group)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.shape == (5, -(-k // group))
    values = codes.float()
    assert float(values.abs().max()) == E4M3_MAX  # each group's largest |x| lands on 448
    restored = values * scales.repeat_interleave(group, 1)[:, :k]
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, plus the subnormal step near 0
    bound = x.abs() * 2**-4 + scales.repeat_interleave(group, 1)[:, :k] * 2**-9
    assert bool(((restored - x).abs() <= bound).all())
    assert float(scales[1, 0]) == 1.0 and not bool(values[1, :group].any())


@pytest.mark.parametrize(
    "fmt,n,k",
    [(FP8Block(), 256, 384), (FP8Block(block=(48, 48)), 70, 100), (FP8Channel(), 40, 96)],
    ids=["block128", "ceil-grid48", "channel"],
)
def test_reference_is_the_exact_sum_of_its_quantized_inputs(fmt, n, k):
    tensors = _weight(fmt, n, k, seed=2)
    weight, w_scales, (bn, bk) = weight_operands(fmt, tensors, (n, k))
    codes, a_scales = quantize_activations(_activations(7, k, seed=3), bk)
    got = fp8_gemm_reference(codes, a_scales, weight, w_scales, (bn, bk))
    want = torch.zeros(7, n, dtype=torch.float64)
    a, w = codes.double(), weight.double()
    for g in range(-(-k // bk)):
        lo, hi = g * bk, min(k, (g + 1) * bk)
        col = w_scales[:, g].double().repeat_interleave(bn)[:n]
        want += (a[:, lo:hi] @ w[:, lo:hi].T) * a_scales[:, g, None].double() * col[None, :]
    assert float((got.double() - want).abs().max()) <= 1e-6 * float(want.abs().max())


def test_the_fp8_gemm_is_near_the_exact_chain_but_not_it():
    fmt, n, k = FP8Block(), 128, 256
    tensors = _weight(fmt, n, k, seed=4)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5))
    exact = x @ fmt.decode(tensors, (n, k), torch.float32).T
    lossy = fp8_linear(fmt, tensors, x, (n, k))
    rel = float((lossy - exact).abs().max()) / float(exact.abs().max())
    assert 1e-4 < rel < 0.05, rel  # e4m3 activations: a few percent at most, never the exact bits


@pytest.mark.parametrize(
    "fmt,m,n,k",
    [(FP8Block(), 70, 192, 256), (FP8Block(block=(48, 48)), 33, 70, 100), (FP8Channel(), 5, 40, 96)],
    ids=["block128", "ceil-grid48", "channel"],
)
def test_triton_kernel_equals_the_torch_path(fmt, m, n, k):
    pytest.importorskip("triton")
    from dgpp.quant.kernels.fp8_gemm import fp8_gemm
    from dgpp.quant.kernels.operands import interpreting

    if not interpreting():
        pytest.skip("the kernel runs on CPU tensors under TRITON_INTERPRET=1 only")
    tensors = _weight(fmt, n, k, seed=6)
    weight, w_scales, block = weight_operands(fmt, tensors, (n, k))
    codes, a_scales = quantize_activations(_activations(m, k, seed=7), block[1])
    want = fp8_gemm_reference(codes, a_scales, weight, w_scales, block)
    got = fp8_gemm(codes, a_scales, weight, w_scales, block, torch.float32)
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    solo = fp8_gemm(codes[:1], a_scales[:1], weight, w_scales, block, torch.float32)
    assert float((solo - got[:1]).abs().max()) <= 1e-6 * float(want.abs().max())


def test_the_lever_is_off_by_default_and_leaves_other_formats_alone():
    fmt, n, k = FP8Block(block=(32, 32)), 64, 64
    tensors = _weight(fmt, n, k, seed=8)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(9))
    assert fp8_prefill_matmul(fmt, tensors, x, (n, k), lambda r: r) is None  # the policy's default: off
    exact = packed_matmul(fmt, tensors, x, (n, k))
    with overriding(prefill_fp8_gemm=True):
        lossy = packed_matmul(fmt, tensors, x, (n, k))
    assert torch.equal(lossy, fp8_linear(fmt, tensors, x, (n, k))) and not torch.equal(lossy, exact)


@pytest.fixture(scope="module")
def fp8_qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_qwen3")
    src = build_tiny_checkpoint("qwen3", root / "src", seed=11)
    return load_model(quantize_checkpoint(src, root / "q", FP8_BLOCKS))


def test_the_lever_moves_fp8_qwen3_logits_by_a_bounded_nonzero_amount(fp8_qwen3):
    rel = lever_row_errors(fp8_qwen3, conf.make_prompts(fp8_qwen3.info.vocab_size, (7, 19, 1), seed=1), LEVER)
    assert bool((rel > 0).all()), "a row the lever should have moved kept the exact bits"
    # every linear's input rounded to 3 mantissa bits, on random weights whose logits are small: 3-11 % here
    assert float(rel.max()) < 0.25, float(rel.max())


def test_fp8_gemm_rows_are_the_same_chunked_or_batched(fp8_qwen3):
    check_lever_exactness(fp8_qwen3, conf.make_prompts(fp8_qwen3.info.vocab_size, (7, 19, 4), seed=2), LEVER)
