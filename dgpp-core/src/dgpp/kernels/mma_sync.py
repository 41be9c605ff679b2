"""Compiling a Triton kernel without Hopper's wgmma.

On sm_90 Triton lowers a dot to wgmma whenever the tile allows (four or more warps, 64 or more rows), else to
``mma.sync``. The two round differently, so a tile that must give the bits of a narrower tile's ``mma.sync``
(the packed decode GEMV's 64-row blocks against its 16-row launches) is compiled with ``DISABLE_MMA_V3`` set: Triton
reads it when it compiles (its disk cache keys on it), not when it launches. Its in-memory cache does not see the
environment, so the kernel takes a constexpr that differs between the two compiles (``MMA_SYNC``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_SWITCH = "DISABLE_MMA_V3"


@contextlib.contextmanager
def mma_sync_compiles(on: bool) -> Iterator[None]:
    """Kernels compiled inside take ``mma.sync`` for every dot when ``on``; the environment is restored after."""
    if not on:
        yield
        return
    before = os.environ.get(_SWITCH)
    os.environ[_SWITCH] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_SWITCH]
        else:
            os.environ[_SWITCH] = before
