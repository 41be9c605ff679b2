"""Tensor names -> modules for the MiMo family: build the model for a ``LoadContext`` and fill every
parameter (``dgpp.engine.weights.load_family_weights``); routed experts load from the per-expert tensors
releases store or transformers' fused ones, the sinks from ``attention_sink_bias`` or ``sinks``.
"""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, Model, UnsupportedModelError, load_family_weights
from dgpp_mimo.config import MimoArchConfig, parse_mimo_config

MIMO_V2_FLASH = ("MiMoV2FlashForCausalLM", "mimo_v2_flash")


def arch_config(ctx: LoadContext) -> MimoArchConfig:
    if ctx.architecture not in MIMO_V2_FLASH:
        raise UnsupportedModelError(f"{ctx.architecture!r} (family MiMo) is claimed by dgpp-mimo but not yet supported")
    return parse_mimo_config(ctx.hf_config)


def load_model(ctx: LoadContext) -> Model:
    from dgpp_mimo.model import MimoV2FlashForCausalLM
    from dgpp_mimo.v26_loader import is_v26, load_v26

    if is_v26(ctx):  # the V2.6 release: its own keys and tensor layout, the same model
        return load_v26(ctx)
    cfg = arch_config(ctx)
    return load_family_weights(ctx, lambda: MimoV2FlashForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world,
                                                                   group=ctx.group))
