"""Tensor names -> modules for the Qwen family."""

from __future__ import annotations

from dgpp.errors import UnsupportedModelError
from dgpp.family import LoadContext


def load_model(ctx: LoadContext):
    raise UnsupportedModelError(
        f"{ctx.architecture!r} (family Qwen) is claimed by dgpp-qwen but not yet supported"
    )
