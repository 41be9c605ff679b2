"""Cases shared by the decode-GEMV tests (``test_decode_gemv``: MMA GEMV, ``test_row_gemv``: CUDA-core row GEMV)."""

from __future__ import annotations

import torch

from dgpp.nn.linear import Linear
from dgpp.quant.encode import encode
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.linear import QuantLinearMethod

FORMATS = [
    FP8Block(),  # 128x128 blocks on a ceil grid: a K that is not a block multiple leaves a partial edge block
    FP8Block(
        block=(16, 48), scale_format="bf16"
    ),  # a K block that is not a power of two (three 16-column spans)
    FP8Block(block=(32, 32), scale_format="e8m0"),
    FP8Channel(),
    NVFP4ModelOpt(),
    NVFP4CompressedTensors(),
    MXFP4(),
]
IDS = [f"{f.name}-{i}" for i, f in enumerate(FORMATS)]


def packed_weights(fmt, n: int, k: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Packed tensors as a layer holds them, and their exact fp32 decode."""
    torch.manual_seed(seed)
    tensors = fmt.prepare(encode(fmt, torch.randn(n, k) * 0.05), (n, k))
    return tensors, fmt.decode(tensors, (n, k), torch.float32)


def packed_layer(fmt, n: int, k: int, seed: int, bias: bool = False) -> Linear:
    """A ``Linear`` loaded with random weights encoded in ``fmt`` through its weight loaders."""
    layer = Linear(k, n, bias=bias, quant_method=QuantLinearMethod(fmt))
    torch.manual_seed(seed)
    shipped = encode(fmt, torch.randn(n, k) * 0.05)
    for suffix in layer.quant_tensor_names:
        param = getattr(layer, suffix)
        param.weight_loader(param, shipped[suffix])
    return layer
