"""Quantized linear ≡ dense linear on the decoded weights; Triton kernels ≡ torch path (interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.nn.linear import Linear
from dgpp.nn.sources import Source  # noqa: F401  (import check: moe sources use it)
from dgpp.quant.encode import encode
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.kernels import TileConfig, quant_matmul
from dgpp.quant.linear import QuantLinearMethod
from dgpp.quant.moe import QuantExperts

FORMATS = [
    FP8Block(block=(16, 32)),
    FP8Block(block=(16, 16), scale_format="bf16"),
    FP8Block(block=(32, 32), scale_format="e8m0"),
    FP8Channel(),
    NVFP4ModelOpt(),
    NVFP4CompressedTensors(),
    MXFP4(),
    IntPacked(bits=4, group=64),
    IntPacked(bits=8, group=64),
    GPTQ(bits=4, group=64),
    GPTQ(bits=8, group=64),
]
IDS = [f"{f.name}-{i}" for i, f in enumerate(FORMATS)]


def _quant_linear(fmt, w: torch.Tensor, bias: bool = False) -> tuple[Linear, dict]:
    n, k = w.shape
    layer = Linear(k, n, bias=bias, quant_method=QuantLinearMethod(fmt))
    shipped = encode(fmt, w)
    for suffix in layer.quant_tensor_names:
        param = getattr(layer, suffix)
        param.weight_loader(param, shipped[suffix])
    if bias:
        layer.bias.data.normal_()
    return layer, shipped


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_quant_linear_equals_dense_on_decoded(fmt):
    torch.manual_seed(0)
    n, k = 48, 192 if fmt.name != "fp8_block" else 200  # 200: a K that is not a block multiple
    if isinstance(fmt, (IntPacked, GPTQ)) or fmt.name.startswith(("nv", "mx")):
        k = 256
    w = torch.randn(n, k) * 0.05
    layer, shipped = _quant_linear(fmt, w, bias=True)
    x = torch.randn(5, k)
    dense = fmt.decode(shipped, (n, k), torch.float32)
    assert torch.equal(layer.quant_method.dense_weight(layer, torch.float32), dense)
    for suffix in layer.quant_tensor_names:  # resident bytes are the shipped bytes (E8M0 grids excepted)
        if shipped[suffix].dtype != torch.float8_e8m0fnu:
            assert getattr(layer, suffix).element_size() == shipped[suffix].element_size(), suffix
    twin = Linear(k, n, bias=True)  # a dense Linear holding the decoded weight: the same bits, row by row
    twin.weight.data.copy_(dense)
    twin.bias.data.copy_(layer.bias)
    assert torch.equal(layer(x), twin(x))
    assert torch.equal(layer(x[2:3]), twin(x)[2:3])  # a row's bits do not depend on the rows beside it
    # the quantization itself is sane: decoded weights stay close to what was encoded
    assert (dense - w).abs().max() <= 0.2 * w.abs().max()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_kernel_matches_torch_path(fmt):
    torch.manual_seed(1)
    n, k = 40, 256  # 40 rows: a partial output tile
    w = torch.randn(n, k) * 0.05
    layer, _ = _quant_linear(fmt, w)
    tensors = layer.quant_method.tensors(layer)
    pack = (
        2
        if fmt.name.startswith(("nv", "mx"))
        else 32 // fmt.bits
        if isinstance(fmt, (IntPacked, GPTQ))
        else 1
    )
    block_k = (
        getattr(fmt, "block", (1, k))[1] if isinstance(fmt, FP8Block) else getattr(fmt, "group", 16) or k
    )
    rowwise = TileConfig(
        bm=1, bn=16, bkp=max(1, block_k // pack), split_k=2
    )  # K tiles inside one scale block
    gathered = TileConfig(bm=1, bn=16, bkp=4)  # tiles smaller than a scale group: per-weight scale gathers
    for rows, cfg in (
        (1, None),
        (3, TileConfig(bm=16, bn=16, bkp=16, split_k=3)),
        (2, rowwise),
        (1, gathered),
    ):
        x = torch.randn(rows, k)
        ref = F.linear(x, fmt.decode(tensors, (n, k), torch.float32))
        got = quant_matmul(fmt, tensors, x, (n, k), cfg)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_gemv_rows_do_not_depend_on_batch():
    """Decode rows are computed alone: row r's bits are the same in a launch of 1 row or of 5."""
    torch.manual_seed(4)
    fmt, n, k = NVFP4ModelOpt(), 40, 256
    layer, _ = _quant_linear(fmt, torch.randn(n, k) * 0.05)
    tensors = layer.quant_method.tensors(layer)
    x = torch.randn(5, k)
    batched = quant_matmul(fmt, tensors, x, (n, k))
    for r in range(5):
        assert torch.equal(quant_matmul(fmt, tensors, x[r : r + 1], (n, k))[0], batched[r])


def test_gptq_act_order_kernel():
    torch.manual_seed(2)
    n, k, fmt = 32, 256, GPTQ(bits=4, group=64)
    g_idx = (torch.arange(k) // 64)[torch.randperm(k)]
    from dgpp.quant.encode import encode_gptq

    shipped = encode_gptq(torch.randn(n, k), fmt, g_idx=g_idx)
    tensors = fmt.prepare(shipped, (n, k))
    assert "g_idx" in tensors
    x = torch.randn(2, k)
    ref = F.linear(x, fmt.decode(tensors, (n, k), torch.float32))
    torch.testing.assert_close(quant_matmul(fmt, tensors, x, (n, k)), ref, rtol=1e-5, atol=1e-5)


def test_quant_experts_per_expert_decode():
    torch.manual_seed(3)
    fmt, experts, hidden, inter = NVFP4ModelOpt(), 4, 32, 48
    moe = QuantExperts(fmt, experts, hidden, inter)
    dense = {}
    sources = moe.checkpoint_sources()
    for proj, shape in (
        ("gate_proj", (inter, hidden)),
        ("up_proj", (inter, hidden)),
        ("down_proj", (hidden, inter)),
    ):
        for e in range(experts):
            w = torch.randn(shape) * 0.1
            shipped = encode(fmt, w)
            dense[proj, e] = fmt.decode(shipped, shape, torch.float32)
            for suffix, t in shipped.items():
                if f"{proj}.{suffix}" in sources:
                    param = getattr(getattr(moe, proj), suffix)
                    param.weight_loader(param, t, e)
    x = torch.randn(6, hidden)
    ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3]])
    weights = torch.rand(6, 2)
    want = torch.zeros_like(x)
    for t in range(6):
        for slot in range(2):
            e = int(ids[t, slot])
            h = F.silu(dense["gate_proj", e] @ x[t]) * (dense["up_proj", e] @ x[t])
            want[t] += weights[t, slot] * (dense["down_proj", e] @ h)
    assert torch.equal(moe.expert_weight("down_proj", 2, torch.float32), dense["down_proj", 2])
    torch.testing.assert_close(moe(x, weights, ids), want, rtol=1e-5, atol=1e-6)


def test_wrong_tensor_shape_names_the_problem():
    layer = Linear(64, 32, quant_method=QuantLinearMethod(FP8Block(block=(16, 16))))
    scale = layer.weight_scale_inv
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        scale.weight_loader(scale, torch.ones(3, 4))


@pytest.mark.parametrize(
    "fmt",
    [FP8Block(block=(16, 32)), FP8Block(block=(32, 32), scale_format="e8m0"), MXFP4(), NVFP4ModelOpt()],
    ids=lambda f: f.name,
)
def test_row_block_equals_the_decoded_rows(fmt):
    """``row_block_linear``: a group of output rows of a packed layer (DeepSeek-V4's grouped wo_a) through the
    format's own row slice where its grid allows the cut, else the decoded rows; both equal the dense rows."""
    from dgpp.nn.linear import row_block_linear

    torch.manual_seed(3)
    n, k = 96, 128
    layer, shipped = _quant_linear(fmt, torch.randn(n, k) * 0.05)
    dense = fmt.decode(shipped, (n, k), torch.float32)
    twin = Linear(k, n)
    twin.weight.data.copy_(dense)
    x = torch.randn(3, k)
    tensors, shape = layer.quant_method.tensors(layer), (n, k)
    for start, stop in ((0, 32), (32, 96), (8, 40)):
        sliced = fmt.row_slice(tensors, shape, start, stop)
        aligned = isinstance(fmt, MXFP4 | NVFP4ModelOpt) or (
            start % fmt.block[0] == 0 and stop % fmt.block[0] == 0
        )
        assert (sliced is not None) == aligned, (start, stop)
        if sliced is not None:
            assert torch.equal(fmt.decode(sliced, (stop - start, k), torch.float32), dense[start:stop])
        assert torch.equal(row_block_linear(layer, x, start, stop), row_block_linear(twin, x, start, stop))
