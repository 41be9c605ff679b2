"""Tensor names -> modules for the Flint family."""

from __future__ import annotations

from dgpp.plugin_api import LoadContext, UnsupportedModelError


def load_model(ctx: LoadContext):
    raise UnsupportedModelError(
        f"{ctx.architecture!r} (family Flint) is claimed by dgpp-flint but not yet supported"
    )
