"""Tensor names -> modules for the MiMo family."""

from __future__ import annotations

from dgpp.errors import UnsupportedModelError
from dgpp.family import LoadContext


def load_model(ctx: LoadContext):
    raise UnsupportedModelError(
        f"{ctx.architecture!r} (family MiMo) is claimed by dgpp-mimo but not yet supported"
    )
