"""Tensor names -> modules for the Flint family."""

from __future__ import annotations

from dgpp.errors import UnsupportedModelError
from dgpp.family import LoadContext


def load_model(ctx: LoadContext):
    raise UnsupportedModelError(
        f"{ctx.architecture!r} (family Flint) is claimed by dgpp-flint but not yet supported"
    )
