"""Tensor names -> modules for the GLM family."""

from __future__ import annotations

from dgpp.errors import UnsupportedModelError
from dgpp.family import LoadContext


def load_model(ctx: LoadContext):
    raise UnsupportedModelError(
        f"{ctx.architecture!r} (family GLM) is claimed by dgpp-glm but not yet supported"
    )
