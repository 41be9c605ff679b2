"""Which 64-row batch tile of the packed decode GEMV gives every row the bits of the decode tile's 16-row launches
on this device, and of those the fastest: probed once per launch kind, format, shapes, tile, dtype and device
(``probed_once``, which the expert GEMM's block-size probe shares)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from dgpp.quant.kernels.gemv_tile import MAX_ROWS, GemvTile

T = TypeVar("T")
# (launch kind, format, shapes, decode tile, dtype, device) -> the batch tile whose rows were found bit-identical to
# the decode tile's 16-row launches on this device, or None (no candidate was: 16-row launches instead)
_EXACT_BATCH: dict[tuple[object, ...], GemvTile | None] = {}
PROBE_ROWS = 80  # a full 64-row block and a partial one
TIMED_LAUNCHES = 5  # per exact candidate, after one warm launch; the median decides


def launch_time_us(launch: Callable[[], object], device: torch.device) -> float:
    """Median GPU time of ``TIMED_LAUNCHES`` launches (CUDA events); 0.0 off CUDA, where every candidate ties and
    the order of preference decides."""
    if device.type != "cuda":
        return 0.0
    launch()
    times = []
    for _ in range(TIMED_LAUNCHES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def probed_once(
    cache: dict[tuple[object, ...], T], key: tuple[object, ...], device: torch.device, probe: Callable[[], T]
) -> T | None:
    """``cache[key]``, set by ``probe()`` the first time. Never probed inside a CUDA-graph capture: None then,
    uncached (the callers' reference launches, which need no probe)."""
    if key not in cache:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cache[key] = probe()
    return cache[key]


def exact_batch_tile(
    key: tuple[object, ...],
    launch: Callable[[torch.Tensor, GemvTile | None], torch.Tensor],
    candidates: list[GemvTile],
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Callable[[Callable[[], object], torch.device], float] = launch_time_us,
) -> GemvTile | None:
    """The fastest (``timer``) of ``candidates`` whose 80-row launch gives every row the bits of 16-row launches
    of the decode tile (``launch(rows, batch)``), probed once per key on random rows; ties go to the earlier
    candidate. A row's chain is the same in both by construction, but the tensor-core instruction may not be
    (Hopper: mma for 16 rows, wgmma for 64), and only the device can say whether they round alike; a candidate
    that fails to compile is skipped. Every candidate kept gives the same bits, so which one is fastest changes
    the time only. Never probed inside a CUDA-graph capture (None then: 16-row launches, which are the
    reference the probe compares with)."""

    def probe() -> GemvTile | None:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(PROBE_ROWS, k, generator=gen, device=device).to(dtype)
        want = torch.cat([launch(x[i : i + MAX_ROWS], None) for i in range(0, PROBE_ROWS, MAX_ROWS)])
        choice, best = None, float("inf")
        for batch in candidates:
            try:
                got = launch(x, batch)
            except Exception:  # noqa: BLE001 (a tile that does not compile or fit on this device is no candidate)
                continue
            if not torch.equal(got, want):
                continue
            took = timer(lambda b=batch: launch(x, b), device)
            if took < best:
                choice, best = batch, took
        return choice

    return probed_once(_EXACT_BATCH, key, device, probe)
