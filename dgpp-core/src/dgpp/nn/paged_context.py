"""Every request's run of cached rows, read from a paged cache in one gather for the whole batch.

A block drafter's rows attend to each request's context (the cached rows at positions ``first .. end - 1``, a
window before the block) beside their own block. Reading the runs one request at a time costs a Python loop and
a few small ops per request; ``context_rows`` reads them as one ``[B, L, ...]`` tensor, ``L`` the longest run, each
request's run *right-aligned* (its padding first, so a request as long as the longest keeps its rows in the
columns, and order, a per-request read gives) with a mask of the columns that hold a row. Padding columns read a
real row (the request's first cached one), so they hold finite values that the mask must keep out.
"""

from __future__ import annotations

import torch


def context_rows(
    flat: torch.Tensor, block_tables: torch.Tensor, block_size: int, first: list[int], end: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows [B, L, ...], positions [B, L] int64, valid [B, L] bool)``: request ``i``'s rows at positions
    ``first[i] .. end[i] - 1`` of the paged cache ``flat`` (``[slots, ...]``, slot = block id x ``block_size`` +
    offset) through its ``block_tables[i]``, right-aligned in the ``L = max(end - first)`` columns."""
    device = flat.device
    lengths = torch.tensor([e - f for f, e in zip(first, end, strict=True)], dtype=torch.int64)
    width = int(lengths.max()) if len(first) else 0
    columns = torch.arange(width, dtype=torch.int64)
    valid = columns[None, :] >= width - lengths[:, None]
    positions = torch.tensor(end, dtype=torch.int64)[:, None] - width + columns[None, :]
    positions = torch.where(valid, positions, 0).to(device)  # position 0's block is every request's first
    blocks = block_tables.long().gather(1, positions // block_size)
    rows = flat[blocks * block_size + positions % block_size]
    return rows, positions, valid.to(device)
