"""Tensor names -> modules for the GLM family: build the model for a ``LoadContext``, give the modules the
checkpoint stores quantized their packed form (ModelOpt NVFP4 for GLM-4.7), then fill every parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dgpp.checkpoint import CheckpointReader, load_weights
from dgpp.errors import UnsupportedModelError
from dgpp.family import LoadContext
from dgpp.quant.apply import convert_dense_weights, quantize_modules
from dgpp_glm.config import Glm4MoeArchConfig, parse_glm4_moe_config

GLM4_MOE = ("Glm4MoeForCausalLM", "glm4_moe")


def checkpoint_name(name: str) -> str:
    """dgpp's shared MoE calls its shared expert ``shared_expert``; GLM checkpoints say ``shared_experts``."""
    return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


def arch_config(ctx: LoadContext) -> Glm4MoeArchConfig:
    if ctx.architecture not in GLM4_MOE:
        raise UnsupportedModelError(f"{ctx.architecture!r} (family GLM) is claimed by dgpp-glm but not yet supported")
    return parse_glm4_moe_config(ctx.hf_config)


def fill(module: nn.Module, ctx: LoadContext, rename: Callable[[str], str], *, packed: bool = True) -> None:
    """Quantized modules first (so their packed parameters exist), then load, then the engine's
    explicit load-time conversions (``engine.dense_weights`` / ``engine.bf16_weights``).
    ``packed=False``: the module's tensors are stored dense whatever ``quantization_config`` says."""
    reader = CheckpointReader(ctx.checkpoint_dir)
    try:
        if packed:  # the packed parameters are created here: on the model's device
            with torch.device(ctx.device or "cpu"):
                quantize_modules(module, ctx.hf_config, rename=rename)
        load_weights(module, reader, rename=rename)
    finally:
        reader.close()
    convert_dense_weights(module, ctx.engine)


def load_model(ctx: LoadContext):
    from dgpp_glm.model import Glm4MoeForCausalLM

    cfg = arch_config(ctx)
    with torch.device(ctx.device or "cpu"):
        model = Glm4MoeForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group)
    fill(model, ctx, checkpoint_name)
    return model.eval()
