"""Core's own weight formats with their default parameters: what ``dgpp.builtin`` answers to
``dgpp_quant_formats``, and what the registry falls back on when the plugin manager is built without core."""

from __future__ import annotations

from dgpp.quant.bf12 import BF12
from dgpp.quant.codebook import NF4Codebook
from dgpp.quant.format import QuantFormat
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import GPTQ, IntPacked


def builtin_formats() -> list[QuantFormat]:
    """FP8 (block, channel), NVFP4 (ModelOpt, compressed-tensors), MXFP4, packed int, GPTQ, NF4I8 and BF12."""
    return [
        FP8Block(),
        FP8Channel(),
        NVFP4ModelOpt(),
        NVFP4CompressedTensors(),
        MXFP4(),
        IntPacked(),
        GPTQ(),
        NF4Codebook(),
        BF12(),
    ]
