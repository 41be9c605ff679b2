"""Tensor names -> modules for the DeepSeek family."""

from __future__ import annotations

from dgpp.errors import UnsupportedModelError
from dgpp.family import LoadContext


def load_model(ctx: LoadContext):
    raise UnsupportedModelError(
        f"{ctx.architecture!r} (family DeepSeek) is claimed by dgpp-deepseek but not yet supported"
    )
