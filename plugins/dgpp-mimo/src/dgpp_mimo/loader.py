"""Tensor names -> modules for the MiMo family."""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, UnsupportedModelError


def load_model(ctx: LoadContext):
    raise UnsupportedModelError(
        f"{ctx.architecture!r} (family MiMo) is claimed by dgpp-mimo but not yet supported"
    )
