"""Tensor names -> modules for the DeepSeek family: build the model for a ``LoadContext`` and fill every parameter
from the release's tensor names (``dgpp_deepseek.names``)."""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, Model, UnsupportedModelError, load_family_weights
from dgpp_deepseek.config import DeepseekV4ArchConfig, parse_deepseek_v4_config
from dgpp_deepseek.names import release_name

DEEPSEEK_V4 = ("DeepseekV4ForCausalLM", "deepseek_v4")


def arch_config(ctx: LoadContext) -> DeepseekV4ArchConfig:
    if ctx.architecture not in DEEPSEEK_V4:
        raise UnsupportedModelError(
            f"{ctx.architecture!r} (family DeepSeek) is claimed by dgpp-deepseek but not yet supported"
        )
    return parse_deepseek_v4_config(ctx.hf_config)


def load_model(ctx: LoadContext) -> Model:
    from dgpp_deepseek.model import DeepseekV4ForCausalLM

    cfg = arch_config(ctx)
    return load_family_weights(
        ctx,
        lambda: DeepseekV4ForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group),
        release_name,
    )
