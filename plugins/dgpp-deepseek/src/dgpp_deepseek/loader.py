"""Tensor names -> modules for the DeepSeek family."""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, UnsupportedModelError


def load_model(ctx: LoadContext):
    raise UnsupportedModelError(
        f"{ctx.architecture!r} (family DeepSeek) is claimed by dgpp-deepseek but not yet supported"
    )
