"""A count of the torch ops a piece of code dispatches (every aten call, views and allocations included): the
CPU decode step's small-op overhead, measured by ``tests/perf/bench_cpu_step.py`` and capped by a test."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """``with DispatchedOps() as counter: ...`` then ``counter.count``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))
