"""A CPU decode row's one large product (the LM head) split by output features over two cores.

A CPU engine runs one intra-op thread on a 2-core machine (``engine.cpu_threads``: the other core serves HTTP), so
a step's products run on one core. The head is the one product large enough for a second core to pay off: its
two halves run at once, one on the engine thread, one on a helper thread that waits on a queue (no spinning, so
the core is the server's again between heads). Handing a product over and back costs ~40-65 us, more than half
of any decoder-layer product of the demo model, so only products of at least ``SPLIT_MIN_OUTPUTS`` outputs split.

Each output feature keeps its bits: a half is the same product over a slice of the weight's outputs, whose
sums do not depend on how many outputs the call makes where the caller checks that once per shape
(``split_verdict``) before it splits.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import torch

SPLIT_MIN_OUTPUTS = 16384
_verdicts: dict[tuple[object, ...], bool] = {}


class _Helper:
    """One daemon thread running jobs in order, without autograd, with one intra-op thread."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], torch.Tensor]] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[torch.Tensor | BaseException] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="dgpp-second-core", daemon=True).start()

    def _run(self) -> None:
        torch.set_num_threads(1)
        with torch.no_grad():
            while True:
                job = self.jobs.get()
                try:
                    self.results.put(job())
                except BaseException as error:  # handed back to the caller, which raises it
                    self.results.put(error)


_helper: _Helper | None = None
_helper_lock = threading.Lock()


def _started_helper() -> _Helper:
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = _Helper()
        return _helper


def spare_core() -> bool:
    """Whether this process runs one intra-op thread on a machine with more cores (the CPU engine's default)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return torch.get_num_threads() == 1 and cores > 1


def split_verdict(key: tuple[object, ...], check: Callable[[], bool]) -> bool:
    """``check()`` (do the halves give the whole product's bits?) once per ``key`` (the product's shape)."""
    verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _verdicts[key] = check()
    return verdict


def on_two_cores(first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cat([first(), second()], -1)`` with ``second`` on the helper thread while ``first`` runs here."""
    helper = _started_helper()
    helper.jobs.put(second)
    try:
        head = first()
    finally:
        tail = helper.results.get()  # always collected, so the next call gets its own result
    if isinstance(tail, BaseException):
        raise tail
    return torch.cat([head, tail], -1)
