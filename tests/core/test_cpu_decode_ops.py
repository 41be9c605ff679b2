"""The CPU decode row's glue: a plain RMSNorm of a narrow row in one ``rms_norm`` call keeps the bits of the
explicit fp32 norm rounded back, and a decode layer of a dense Llama model dispatches no more torch ops than
it does now (each small op costs 1.5-3 us on a 2-core CPU after the products have streamed their weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.nn.norm import RMSNorm
from dgpp.testing.dispatched_ops import DispatchedOps

GEN = torch.Generator().manual_seed(5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_plain_norm_rounds_the_fp32_norm_then_multiplies(dtype):
    norm = RMSNorm(576, 1e-5, dtype=dtype)
    norm.weight.data.copy_(torch.randn(576, generator=GEN))
    for scale in (1e-3, 1.0, 30.0, 700.0):
        x = (torch.randn(7, 576, generator=GEN) * scale).to(dtype)
        explicit = norm.weight * F.rms_norm(x.float(), (576,), eps=1e-5).to(dtype)
        assert torch.equal(norm(x), explicit), scale


def test_a_plain_float64_norm_multiplies_in_float64():
    norm = RMSNorm(64, 1e-6, dtype=torch.float64)
    norm.weight.data.copy_(torch.randn(64, generator=GEN, dtype=torch.float64))
    x = torch.randn(5, 64, generator=GEN, dtype=torch.float64)
    assert torch.equal(norm(x), norm.weight * F.rms_norm(x.float(), (64,), eps=1e-6).double())


def test_the_fp32_product_orders_keep_their_rounding():
    x = (torch.randn(5, 64, generator=GEN) * 3).to(torch.bfloat16)
    w = torch.randn(64, generator=GEN).to(torch.bfloat16)
    normed = F.rms_norm(x.float(), (64,), eps=1e-6)
    centred = RMSNorm(64, zero_centered=True, dtype=torch.bfloat16)
    centred.weight.data.copy_(w)
    assert torch.equal(centred(x), (normed * (1.0 + w.float())).to(torch.bfloat16))

    class Fp32Product(RMSNorm):
        fp32_product = True

    product = Fp32Product(64, dtype=torch.bfloat16)
    product.weight.data.copy_(w)
    assert torch.equal(product(x), (w.float() * normed).to(torch.bfloat16))


def _decode_step_ops(tmp_path, layers: int, dtype: torch.dtype) -> int:
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.startup.loading import load_model
    from dgpp.step.pools import CachePools
    from dgpp.testing.builders import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(
        "llama", tmp_path / f"hf{layers}", seed=3, overrides={"num_hidden_layers": layers}
    )
    model = load_model(checkpoint, dtype=dtype)
    runner = ModelRunner(model, CachePools(model.cache_spec(), 8, 16, 1))
    table = list(range(8))
    runner.step([SeqWork(0, table, 0, list(range(5, 25)))])
    runner.step([SeqWork(0, table, 20, [7])])  # first decode products check their shapes
    with DispatchedOps() as counter:
        runner.step([SeqWork(0, table, 21, [8])])
    return counter.count


# dispatched torch ops of one decode layer of the tiny dense Llama, one row, one sequence
LAYER_OPS = {torch.float32: 48, torch.bfloat16: 55}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_decode_layer_dispatches_no_more_ops(tmp_path, dtype):
    pytest.importorskip("dgpp_llama", reason="the example plugin is installed by scripts/setup.sh")
    per_layer = (_decode_step_ops(tmp_path, 4, dtype) - _decode_step_ops(tmp_path, 2, dtype)) / 2
    assert 0 < per_layer <= LAYER_OPS[dtype], per_layer  # 0: nothing counted
