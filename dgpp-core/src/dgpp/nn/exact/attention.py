"""Paged decode attention whose every row depends on that row alone (its query, ``seq_len`` and table).

``paged_decode_attention_triton`` sizes its split grid from the batch and the table width
(``plan_partition``), and each sequence spreads its context over that many splits: a row's partial sums,
and so its last bit, change with how many other rows share the step. Here the grid always has
``exact_splits`` splits (``dgpp.policy``, 32), so a sequence's cut (``BLOCK_N``-token multiples, decided on the device from its
``seq_len``) and the merge's reduction width are the same in every step: plain decode at any batch size,
a speculative verify's rows (each its own decode row) and a prompt run row by row all agree bit for bit.
The launch is ``dgpp.kernels.paged_attention.decode_attention_with_splits``; only the split count is
pinned. Contexts up to ``BLOCK_N`` tokens are written directly by split 0, longer ones merged over at most
``exact_splits`` parts.
"""

from __future__ import annotations

import torch

from dgpp.kernels.kv_fp8 import KVScales
from dgpp.kernels.paged_attention import decode_attention_with_splits, programs_per_row
from dgpp.policy import current


def paged_decode_attention_fixed(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    splits: int | None = None,
    scales: KVScales = None,
) -> torch.Tensor:
    """``paged_decode_attention`` with ``splits`` fixed (rows independent of the batch and table width).
    The programs per (row, KV head) follow the batch (``programs_per_row``): that never changes a row's
    bits, and at batch 64 it keeps the grid at 1024 programs instead of 16384 mostly idle ones.
    ``splits`` defaults to the policy's ``exact_splits``; ``scales``: an e4m3 pool's row scales."""
    splits = current().exact_splits if splits is None else splits
    if splits < 1:
        raise ValueError(f"paged_decode_attention_fixed needs at least 1 split, got {splits}")
    grid = programs_per_row(q.shape[0], k_cache.shape[2])
    return decode_attention_with_splits(
        q, k_cache, v_cache, block_tables, seq_lens, scale, window, splits, grid, scales=scales
    )


def expand_rows(
    block_tables: torch.Tensor, seq_lens_cpu: list[int], q_lens_cpu: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query row as its own decode row: ``(row index, block tables, seq_lens)``.

    Row ``j`` of a sequence with ``n`` rows and ``seq_len`` tokens attends to ``seq_len - n + j + 1`` tokens
    through its own table, exactly the decode row of that position. Built from host lists (no device sync);
    sequences with no rows are skipped, a padding sequence (``seq_len`` 0) stays a zero-length row."""
    seq_of_row: list[int] = []
    lens: list[int] = []
    for i, (length, n) in enumerate(zip(seq_lens_cpu, q_lens_cpu, strict=True)):
        seq_of_row.extend([i] * n)
        lens.extend(range(length - n + 1, length + 1) if length else [0] * n)
    device = block_tables.device
    index = torch.tensor(seq_of_row, dtype=torch.int64).to(device, non_blocking=True)
    seq_lens = torch.tensor(lens, dtype=torch.int32).to(device, non_blocking=True)
    return index, block_tables.index_select(0, index), seq_lens
