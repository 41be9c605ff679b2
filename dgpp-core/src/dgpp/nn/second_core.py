"""A CPU step's one large product (the LM head, dense or int4-packed) split by output features over two cores.

A CPU engine runs one intra-op thread on a 2-core machine (``engine.cpu_threads``: the other core serves HTTP), so
a step's products run on one core. The head is the one product large enough for a second core to pay off: its
two halves run at once, one on the engine thread, one on a helper thread that waits on a queue (no spinning, so
the core is the server's again between heads). Handing a product over and back costs more than half of a small
model's decoder-layer product (docs/benchmarks.md, "CPU demo: the head on two cores"), so only products of at
least ``SPLIT_MIN_OUTPUTS`` outputs split: a dense head whatever its row count, an int4-packed one for a decode row.

Each output feature keeps its bits: a half is the same product over a slice of the weight's outputs, whose
sums do not depend on how many outputs the call makes where that is checked once per shape (``split_verdict``)
before anything splits.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import torch
from torch import nn

from dgpp.nn.batch_invariant import batch_invariant_linear

SPLIT_MIN_OUTPUTS = 16384
CUT_MULTIPLE = 64  # halves cut at whole vector blocks of outputs
_verdicts: dict[tuple[object, ...], bool] = {}


class _Helper:
    """One daemon thread running jobs in order, without autograd, with one intra-op thread."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], torch.Tensor]] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[torch.Tensor | BaseException] = queue.SimpleQueue()
        self.turn = threading.Lock()
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


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def spare_core() -> bool:
    """Whether this process runs one intra-op thread on a machine with more cores (the CPU engine's default)."""
    return torch.get_num_threads() == 1 and usable_cores() > 1


def split_verdict(key: tuple[object, ...], check: Callable[[], bool]) -> bool:
    """``check()`` (do the halves give the whole product's bits?) once per ``key`` (the product's shape)."""
    verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _verdicts[key] = check()
    return verdict


def on_two_cores(first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cat([first(), second()], -1)`` with ``second`` on the helper thread while ``first`` runs here. Callers on
    several threads take turns (one helper, one result queue)."""
    helper = _started_helper()
    with helper.turn:
        helper.jobs.put(second)
        try:
            head = first()
        finally:
            tail = helper.results.get()  # always collected, so the next call gets its own result
    if isinstance(tail, BaseException):
        raise tail
    return torch.cat([head, tail], -1)


def two_core_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``batch_invariant_linear(rows, weight)`` on the CPU as two halves of ``weight``'s outputs on two cores;
    None where it does not split (a small weight, no spare core, or halves that would not give the whole
    product's bits for this shape, checked once on one-row products of random data: a row's bits do not depend
    on its batch in either product, so several rows keep them too). The halves are parameters viewing
    ``weight`` (so the CPU product keeps its per-parameter forms, e.g. oneDNN's packed copy of each half, and
    no packed copy of the whole is made), kept on it."""
    if rows.device.type != "cpu" or weight.shape[0] < SPLIT_MIN_OUTPUTS or not spare_core():
        return None
    key = ("dense", weight.dtype, *weight.shape)
    if not split_verdict(key, lambda: _halves_exact(weight.dtype, *weight.shape)):
        return None
    return _split_product(rows, *_halves(weight))


def _split_product(rows: torch.Tensor, first: nn.Parameter, second: nn.Parameter) -> torch.Tensor:
    return on_two_cores(
        lambda: batch_invariant_linear(rows, first), lambda: batch_invariant_linear(rows, second)
    )


def _halves(weight: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """Two parameters viewing ``weight``'s outputs, cut at a multiple of ``CUT_MULTIPLE``: cached on the weight,
    remade if its storage moves."""
    cached = getattr(weight, "_dgpp_halves", None)
    if cached is None or cached[0] != weight.data_ptr():
        cut = weight.shape[0] // 2 // CUT_MULTIPLE * CUT_MULTIPLE
        data = weight.detach()
        halves = (
            nn.Parameter(data[:cut], requires_grad=False),
            nn.Parameter(data[cut:], requires_grad=False),
        )
        cached = (weight.data_ptr(), halves)
        weight._dgpp_halves = cached
    return cached[1]


def _halves_exact(dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """Whether a random ``[out, in]`` parameter's halves give the whole product's bits for three random rows."""
    gen = torch.Generator().manual_seed(0)
    weight = nn.Parameter(
        torch.randn(out_features, in_features, generator=gen).to(dtype), requires_grad=False
    )
    rows = torch.randn(3, in_features, generator=gen).to(dtype)
    halves = _halves(weight)
    with torch.inference_mode():
        return all(
            torch.equal(_split_product(row, *halves), batch_invariant_linear(row, weight))
            for row in rows.split(1)
        )
