"""``dgpp.nn.paged_context.context_rows``: every request's run of cached rows in one gather, right-aligned, with
the mask of the columns that hold a row."""

from __future__ import annotations

import torch

from dgpp.nn.paged_context import context_rows


def test_each_run_is_the_per_request_read_right_aligned():
    block_size, gen = 4, torch.Generator().manual_seed(0)
    flat = torch.randn(10 * block_size, 2, 3, generator=gen)  # 10 blocks of 4 slots, rows of [2, 3]
    tables = torch.tensor([[7, 2, 5, -1], [1, -1, -1, -1], [9, 0, 3, 8]], dtype=torch.int32)
    first, end = [3, 0, 6], [11, 2, 16]  # runs of 8, 2 and 10 rows, crossing blocks
    rows, positions, valid = context_rows(flat, tables, block_size, first, end)
    assert rows.shape == (3, 10, 2, 3) and positions.shape == valid.shape == (3, 10)
    for i, (f, e) in enumerate(zip(first, end, strict=True)):
        at = torch.arange(f, e)
        alone = flat[tables[i].long()[at // block_size] * block_size + at % block_size]
        n = e - f
        assert torch.equal(rows[i, 10 - n :], alone)  # the same rows, in the same columns' order
        assert torch.equal(positions[i, 10 - n :], at)
        assert valid[i].tolist() == [False] * (10 - n) + [True] * n
        assert torch.isfinite(rows[i, : 10 - n]).all()  # padding reads a real row


def test_no_request_no_columns():
    rows, positions, valid = context_rows(
        torch.zeros(8, 2), torch.zeros(2, 2, dtype=torch.int32), 4, [3, 1], [3, 1]
    )
    assert rows.shape == (2, 0, 2) and positions.shape == valid.shape == (2, 0)
