"""Cross-program split-K for the decode GEMVs (the packed ``dgpp.quant.kernels.decode_gemv`` and the dense
``dgpp.kernels.gemv``): each program's K slice and row block, its fp32 partial published to a workspace, and the
tile's last-arriving program summing the partials in split order (a fixed order, so the result does not depend
on which program finished last)."""

from __future__ import annotations

import functools

import torch

from dgpp.kernels._triton import tl, triton

# per-device arrival counters (one per (row block, output tile) of a launch), zero between launches: the last
# program of a tile re-arms its own, so the dense and the packed split launches of one stream share them
_COUNTERS: dict[torch.device, torch.Tensor] = {}
MIN_COUNTERS = 16384  # cover the 8B shapes' tiles for 1,024 rows without a regrowth


@functools.cache
def device_sm_count(device: torch.device) -> int:
    """The SM count a split rule spreads a launch's programs over (queried once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def arrival_counters(device: torch.device, needed: int, launch: str) -> torch.Tensor:
    """At least ``needed`` zeroed arrival counters on ``device``. Allocated (or grown) at the first split launch
    that needs them, eagerly: the engine warms every graph size up before capturing it. Never inside a CUDA-graph
    capture, where their zero fill would not run: that is an error naming ``launch``, not a silent unsplit launch
    whose rows would differ in the last bit."""
    cnt = _COUNTERS.get(device)
    if cnt is None or cnt.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{launch}: split-K arrival counters must be allocated by an eager call before CUDA-graph "
                f"capture ({needed} needed)"
            )
        cnt = _COUNTERS[device] = torch.zeros(max(needed, MIN_COUNTERS), dtype=torch.int32, device=device)
    return cnt


@triton.jit
def k_slice_range(k_dim, k_per_split):
    """This program's K slice: ``k_per_split`` columns each (the host's ``k_slice``: whole steps of the decode
    tile's BK, from the shape alone, so the slices never depend on M)."""
    k_lo = tl.program_id(1) * k_per_split
    return k_lo, tl.minimum(k_lo + k_per_split, k_dim)


@triton.jit
def ws_offsets(split_id, part, SPLIT: tl.constexpr, PARTS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
    """Workspace slots of (row block, split, part, tile): row block ``program_id(2)``, tile ``program_id(0)``."""
    slot = (tl.program_id(2) * SPLIT + split_id) * PARTS + part
    base = (slot * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * (BN * BM)
    return base + tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]


@triton.jit
def publish_partial(
    ws_ptr, acc, part, m, SPLIT: tl.constexpr, PARTS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr
):
    """Store this K slice's partial (rows < m only) for the program that finishes the tile."""
    offs = ws_offsets(tl.program_id(1), part, SPLIT, PARTS, BN, BM)
    tl.store(ws_ptr + offs, acc, mask=tl.arange(0, BM)[None, :] < m)


@triton.jit
def row_block_ptrs(x_ptr, out_ptr, m, x_stride, out_stride, BM: tl.constexpr):
    """This program's row block (grid axis 2): x and out moved to its first row, ``m`` its rows left."""
    first = tl.program_id(2) * BM
    return x_ptr + first * x_stride, out_ptr + first * out_stride, m - first


@triton.jit
def arrive_last(cnt_ptr, SPLIT: tl.constexpr):
    """True in the last of the tile's SPLIT programs to finish (acq_rel: it sees every partial), which also
    re-arms the counter for the next launch. The barrier orders every thread's partial stores before the
    one thread's release (the bar.sync then gpu-scope release chain of the PTX memory model)."""
    tl.debug_barrier()
    slot = (
        cnt_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    )  # one counter per (row block, tile)
    count = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
    last = count == SPLIT - 1
    if last:
        tl.store(slot, 0)
    return last


@triton.jit
def gather_partials(
    ws_ptr, part, m, SPLIT: tl.constexpr, PARTS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr
):
    """The tile's partials summed in split order (fixed, so the result does not depend on who finished last)."""
    total = tl.zeros([BN, BM], tl.float32)
    for split_id in tl.static_range(SPLIT):
        offs = ws_offsets(split_id, part, SPLIT, PARTS, BN, BM)
        total += tl.load(ws_ptr + offs, mask=tl.arange(0, BM)[None, :] < m, other=0.0, cache_modifier=".cg")
    return total
