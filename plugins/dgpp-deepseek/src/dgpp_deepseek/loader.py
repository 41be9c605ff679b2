"""DeepSeek-V4's own load (a model hook: the release decides by its tensor names what is packed, and its draft
stages ride along): the model for a ``LoadContext`` through core's pipeline (``load_family_weights``), with the
quantization the release's names resolve (FP8 E4M3 with E8M0 block scales, MXFP4 routed experts:
``dgpp_deepseek.release_layout``; what the checkpoint stores dense stays dense), every parameter filled from
the release's tensor names (``dgpp_deepseek.names``, then the ``.scale`` suffix)."""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, Model, load_family_weights
from dgpp_deepseek.config import DeepseekV4ArchConfig
from dgpp_deepseek.names import release_name
from dgpp_deepseek.release_layout import release_context, release_tensor_name

checkpoint_name = release_tensor_name(release_name)


def load_model(ctx: LoadContext) -> Model:
    from dgpp_deepseek.draft_blocks import attach_draft_blocks
    from dgpp_deepseek.model import DeepseekV4ForCausalLM

    cfg = DeepseekV4ArchConfig.from_hf_config(ctx.hf_config)
    ctx = release_context(ctx)

    def build() -> (
        DeepseekV4ForCausalLM
    ):  # the release's mtp.* stages ride along (the DSpark drafter runs them)
        model = DeepseekV4ForCausalLM(cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group)
        return attach_draft_blocks(model, cfg, ctx.checkpoint_dir, world=ctx.world)

    return load_family_weights(ctx, build, checkpoint_name)
