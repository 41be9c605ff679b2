"""Quantized linears under tensor parallelism: each rank's packed slice decodes to its slice of the weight."""

from __future__ import annotations

import pytest
import torch

from dgpp.family import World
from dgpp.nn.linear import Linear
from dgpp.nn.weights import WeightShapeError
from dgpp.quant.encode import encode
from dgpp.quant.fp4 import NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.linear import QuantLinearMethod

FORMATS = [FP8Block(block=(16, 16)), NVFP4ModelOpt(), IntPacked(bits=4, group=32), GPTQ(bits=4, group=32)]


def _rank_layer(fmt, parallel: str, rank: int, shipped: dict, n: int, k: int) -> Linear:
    layer = Linear(
        k, n, parallel=parallel, world=World(rank=rank, size=2), quant_method=QuantLinearMethod(fmt)
    )
    for suffix in layer.quant_tensor_names:
        param = getattr(layer, suffix)
        param.weight_loader(param, shipped[suffix])
    return layer


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", ["column", "row"])
def test_rank_slices_decode_to_weight_slices(fmt, parallel):
    n, k = 64, 128
    shipped = encode(fmt, torch.randn(n, k, generator=torch.Generator().manual_seed(9)))
    full = fmt.decode(shipped, (n, k), torch.float32)
    layers = [_rank_layer(fmt, parallel, r, shipped, n, k) for r in range(2)]
    decoded = [layer.quant_method.dense_weight(layer, torch.float32) for layer in layers]
    assert torch.equal(torch.cat(decoded, dim=0 if parallel == "column" else 1), full)


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_fp8_grid_reblocked_when_slices_cut_blocks(parallel):
    """40 rows / 2 ranks = 20 per rank on 16-row blocks (Qwen experts: 640/W on 128): the grid is
    re-blocked to gcd(20, 16) = 4 with replicated scales, which is exact."""
    fmt, n, k = FP8Block(block=(16, 16)), 40, 48
    shipped = encode(fmt, torch.randn(n, k, generator=torch.Generator().manual_seed(4)))
    full = fmt.decode(shipped, (n, k), torch.float32)
    layers = [_rank_layer(fmt, parallel, r, shipped, n, k) for r in range(2)]
    assert layers[0].quant_method.fmt.block == ((4, 16) if parallel == "column" else (16, 8))
    decoded = [layer.quant_method.dense_weight(layer, torch.float32) for layer in layers]
    assert torch.equal(torch.cat(decoded, dim=0 if parallel == "column" else 1), full)


def test_unaligned_slice_is_refused_by_name():
    fmt = NVFP4ModelOpt()  # 48 input columns / 2 ranks = 24: not whole 16-column groups
    with pytest.raises(ValueError, match="this format cannot be re-blocked"):
        Linear(48, 64, parallel="row", world=World(rank=1, size=2), quant_method=QuantLinearMethod(fmt))
    layer = Linear(
        96,
        64,
        parallel="column",
        world=World(rank=1, size=2),
        quant_method=QuantLinearMethod(FP8Block(block=(16, 16))),
    )
    param = layer.weight_scale_inv
    with pytest.raises(WeightShapeError, match="cannot be split"):  # a grid of the wrong size for this world
        param.weight_loader(param, torch.ones(3, 6))


def test_gptq_act_order_column_parallel_keeps_g_idx_whole():
    fmt, n, k = GPTQ(bits=4, group=32), 64, 128
    from dgpp.quant.encode import encode_gptq

    g_idx = (torch.arange(k) // 32)[torch.randperm(k, generator=torch.Generator().manual_seed(3))]
    shipped = encode_gptq(torch.randn(n, k), fmt, g_idx=g_idx)
    full = fmt.decode(shipped, (n, k), torch.float32)
    layers = []
    for r in range(2):
        layer = Linear(
            k,
            n,
            parallel="column",
            world=World(rank=r, size=2),
            quant_method=QuantLinearMethod(fmt, act_order=True),
        )
        for suffix in layer.quant_tensor_names:
            param = getattr(layer, suffix)
            param.weight_loader(param, shipped[suffix])
        layers.append(layer)
    decoded = [layer.quant_method.dense_weight(layer, torch.float32) for layer in layers]
    assert torch.equal(torch.cat(decoded, dim=0), full)
    with pytest.raises(ValueError, match="act-order"):
        Linear(
            k,
            n,
            parallel="row",
            world=World(rank=0, size=2),
            quant_method=QuantLinearMethod(fmt, act_order=True),
        )
