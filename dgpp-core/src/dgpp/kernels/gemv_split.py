"""Split-K for the dense decode GEMV (``dgpp.kernels.gemv``) on shapes whose output tiles leave SMs idle.

A launch of ``N / 16`` output tiles (the 16-row tile's 16-wide columns) under the SM count runs each tile's whole
K in one program, so most SMs sit idle: DeepSeek-V4's 1024 x 4096 query down-projection is 64 programs on an
H100's 132 SMs, a 256 x 4096 router 16, a hyper-connection's 24 x 16384 mixer 2. Those launches cut K into
``split`` contiguous slices instead: each program streams one slice of one tile, publishes its fp32 partial,
and the tile's last program to arrive sums the partials in slice order (0 + 1 + ...), then rounds once to the
output dtype (``dgpp.kernels.split_partials``, as the packed decode GEMV does).

The rule (``split_count``): outputs of ``FILLING_COLUMNS`` columns or more keep the unsplit launch (their
16-row tile is 32 wide and its grid already fills the GPU: every Qwen3-8B projection, wide q/k/v, the heads);
narrower ones double the split until the launch has ``MIN_PROGRAMS_PER_SM`` programs per SM, at most
``MAX_SPLIT`` slices of at least ``MIN_SLICE_STEPS`` x ``SLICE_ALIGN`` columns each. The split is a function of
the shape and the SM count only, never of the row count, so a row's bits do not depend on how many rows share
the launch; the slices are whole multiples of ``SLICE_ALIGN`` columns whatever the tile's ``BK``, so each
slice's chain of k-steps is the same for every row class and tile width. A gate/up pair splits by its
intermediate width (DeepSeek-V4's and GLM-5.3's 2048-wide shared experts: 64 programs of two 32-wide tiles
unsplit). The fixed-order linears (``dgpp.nn.exact.gemm``) keep these kernels for split shapes at every row
count, so prefill-size calls give their rows the decode rows' bits.
"""

from __future__ import annotations

import math

import torch

from dgpp.kernels.split_partials import arrival_counters, device_sm_count

FILLING_COLUMNS = 4096  # from here on ``_tile`` picks 32-wide tiles: the grid fills the SMs, K is never split
MIN_PROGRAMS_PER_SM = 1.5
MAX_SPLIT = 32
SLICE_ALIGN = 256  # K columns: slice boundaries are multiples of it, whatever the tile's BK
MIN_SLICE_STEPS = 2  # a slice streams at least this many SLICE_ALIGN-wide steps
NARROW_BN = 16


def split_count(n_total: int, k_dim: int, sms: int | None) -> int:
    """K slices for a launch of ``n_total`` output columns over ``k_dim``: 1 without an SM count (CPU) or for
    outputs that fill the GPU, else the smallest power of two giving ``MIN_PROGRAMS_PER_SM`` programs per SM
    (within ``MAX_SPLIT`` and the slice length floor). Depends on the shape and the SM count alone."""
    if sms is None or n_total >= FILLING_COLUMNS:
        return 1
    tiles = max(1, n_total // NARROW_BN)
    split = 1
    while (
        split < MAX_SPLIT
        and tiles * split < MIN_PROGRAMS_PER_SM * sms
        and k_dim // (2 * split) >= MIN_SLICE_STEPS * SLICE_ALIGN
    ):
        split *= 2
    return split


def slice_columns(k_dim: int, split: int) -> int:
    """K columns per slice: ``k_dim / split`` rounded up to whole ``SLICE_ALIGN`` steps (the last slice may be
    shorter, or empty)."""
    return math.ceil(math.ceil(k_dim / split) / SLICE_ALIGN) * SLICE_ALIGN


def device_sms(x: torch.Tensor) -> int | None:
    """The SM count the rule sees for ``x``: its GPU's, or None (no split) off CUDA (the interpreter and CPU
    tests pass one in) and under ``DGPP_GEMV_SPLIT=0`` (the policy's ``gemv_split``, fixed for the process)."""
    from dgpp.policy import current

    # the device's type, not ``x.is_cuda``: the CPU launch counter (dgpp.bench.launches) answers is_cuda yes
    return device_sm_count(x.device) if x.device.type == "cuda" and current().gemv_split else None


def split_buffers(
    split: int, tiles: int, blocks: int, bn: int, bm: int, device: torch.device, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace for the partials, ``parts`` per program, arrival counters) of a split launch
    (``split_partials.arrival_counters``: never first allocated inside a CUDA-graph capture)."""
    cnt = arrival_counters(device, tiles * blocks, "dense split-K GEMV")
    ws = torch.empty(split * parts * tiles * blocks * bn * bm, dtype=torch.float32, device=device)
    return ws, cnt
