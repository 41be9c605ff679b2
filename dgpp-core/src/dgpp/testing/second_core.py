"""Tests of products split over two cores (``dgpp.nn.second_core``): one intra-op thread, and a count of the splits
a module makes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import pytest


@contextmanager
def counted_splits(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> Iterator[list[int]]:
    """One intra-op thread (the CPU engine's default on 2 cores) while the block runs; the list gets an entry for
    every product ``module`` hands to ``on_two_cores``."""
    splits: list[int] = []
    real = module.on_two_cores
    monkeypatch.setattr(module, "on_two_cores", lambda first, second: splits.append(1) or real(first, second))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield splits
    finally:
        torch.set_num_threads(threads)
