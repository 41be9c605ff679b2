"""Packed experts through the fused grouped GEMM (Triton interpreter) against the per-expert decode reference."""

from __future__ import annotations

import pytest
import torch

from dgpp.quant.encode import encode
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.kernels.moe_launch import MoETiles, fused_quant_moe
from dgpp.quant.moe import QuantExperts

FORMATS = [
    FP8Block(block=(128, 128)),
    FP8Block(block=(32, 32), scale_format="e8m0"),
    FP8Block(block=(16, 16), scale_format="bf16"),
    FP8Channel(),
    NVFP4ModelOpt(),
    NVFP4CompressedTensors(),
    MXFP4(),
    IntPacked(bits=4, group=64),
    IntPacked(bits=8, group=32),
    GPTQ(bits=4, group=64),
]
IDS = [f"{f.name}-{i}" for i, f in enumerate(FORMATS)]
HIDDEN, INTER, EXPERTS = 128, 64, 8


def build_experts(fmt, seed: int, experts: int = EXPERTS, hidden: int = HIDDEN, inter: int = INTER) -> QuantExperts:
    """QuantExperts loaded through its weight loaders with freshly encoded random weights."""
    gen = torch.Generator().manual_seed(seed)
    moe = QuantExperts(fmt, experts, hidden, inter)
    for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
        stack = getattr(moe, proj)
        for e in range(experts):
            shipped = encode(fmt, torch.randn(shape, generator=gen) * shape[1] ** -0.5)
            for suffix in stack.names:
                param = getattr(stack, suffix)
                param.weight_loader(param, shipped[suffix], e)
    return moe


def routing(tokens: int, top_k: int, seed: int, experts: int = EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_fused_equals_reference_fp32(fmt):
    moe = build_experts(fmt, seed=1)
    for tokens, top_k in ((1, 2), (5, 3), (40, 2)):  # 40 x 2 assignments take the 64-row prefill blocks
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        weights, ids = routing(tokens, top_k, seed=tokens)
        want = moe.forward_reference(x, weights, ids)
        moe.use_fused = True
        got = moe(x, weights, ids)
        moe.use_fused = None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _forbid_host_sync(patch: pytest.MonkeyPatch) -> None:
    """Make every way a CUDA tensor's value reaches the host raise (here on CPU tensors): reading a value
    (.item, .tolist, bool/int/float), or ops whose output shape depends on the data."""

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host sync: {name}")
        return raise_

    for name in ("item", "tolist", "nonzero", "unique", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        patch.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
    for name in ("nonzero", "unique", "bincount", "masked_select", "argwhere", "unique_consecutive"):
        patch.setattr(torch, name, forbidden(f"torch.{name}"))
    real_where = torch.where
    patch.setattr(torch, "where", lambda cond, *rest: real_where(cond, *rest) if rest else forbidden("where")())


def test_fused_path_never_reads_values_back(monkeypatch):
    """What makes the layer capturable: no value goes to the host and every shape follows from T, K, E.
    The reference, which loops over the picked experts, trips the same guard."""
    moe = build_experts(NVFP4ModelOpt(), seed=2)
    x = torch.randn(3, HIDDEN)
    weights, ids = routing(3, 2, seed=3)
    want = moe.forward_reference(x, weights, ids)
    moe.use_fused = True
    with monkeypatch.context() as patch:
        _forbid_host_sync(patch)
        got = moe(x, weights, ids)
        with pytest.raises(AssertionError, match="host sync"):
            moe.forward_reference(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
