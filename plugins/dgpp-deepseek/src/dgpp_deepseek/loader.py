"""Tensor names -> modules for the DeepSeek family: build the model for a ``LoadContext``, give the modules the
release stores packed their packed form (FP8 E4M3 with E8M0 block scales, MXFP4 routed experts:
``dgpp_deepseek.release_layout``; what the checkpoint stores dense stays dense), and fill every parameter from
the release's tensor names (``dgpp_deepseek.names``, then the ``.scale`` suffix)."""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, Model, UnsupportedModelError, load_family_weights
from dgpp_deepseek.config import DeepseekV4ArchConfig, parse_deepseek_v4_config
from dgpp_deepseek.names import release_name
from dgpp_deepseek.release_layout import release_context, release_tensor_name

checkpoint_name = release_tensor_name(release_name)

DEEPSEEK_V4 = ("DeepseekV4ForCausalLM", "deepseek_v4")


def arch_config(ctx: LoadContext) -> DeepseekV4ArchConfig:
    if ctx.architecture not in DEEPSEEK_V4:
        raise UnsupportedModelError(
            f"{ctx.architecture!r} (family DeepSeek) is claimed by dgpp-deepseek but not yet supported"
        )
    return parse_deepseek_v4_config(ctx.hf_config)


def load_model(ctx: LoadContext) -> Model:
    from dgpp_deepseek.draft_blocks import attach_draft_blocks
    from dgpp_deepseek.model import DeepseekV4ForCausalLM

    cfg = arch_config(ctx)
    ctx = release_context(ctx)

    def build() -> DeepseekV4ForCausalLM:  # the release's mtp.* stages ride along, loaded and named, not run
        model = DeepseekV4ForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group)
        return attach_draft_blocks(model, cfg, ctx.checkpoint_dir, world=ctx.world)

    return load_family_weights(ctx, build, checkpoint_name)
