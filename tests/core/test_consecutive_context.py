"""A lone stream's blocks are consecutive pool ids: its context is then read as one view of the pool, not
gathered, with the same attention bits as the gather."""

from __future__ import annotations

import torch

from dgpp.nn.attention import _context_rows, consecutive_span, gather_rows, paged_attention


class _Step:
    """The batch fields paged attention reads for one sequence's decode row."""

    def __init__(self, table: list[int], length: int) -> None:
        self.num_seqs, self.q_lens_cpu = 1, [1]
        self.seq_lens_cpu, self.context_lens_cpu = [length], [length - 1]
        self.block_tables = torch.tensor([table], dtype=torch.int32)
        self._memo: dict = {}

    def step_memo(self, key, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]


def test_consecutive_blocks_are_one_span_and_others_are_not():
    table = torch.tensor([5, 6, 7, -1], dtype=torch.int32)
    assert consecutive_span(table, 40, 16) == slice(80, 120)
    assert consecutive_span(table, 48, 16) == slice(80, 128)
    assert consecutive_span(table, 49, 16) is None  # the fourth block is not allocated
    assert consecutive_span(torch.tensor([5, 7, 8], dtype=torch.int32), 40, 16) is None
    assert consecutive_span(torch.tensor([6, 5], dtype=torch.int32), 20, 16) is None
    assert consecutive_span(table, 0, 16) is None


def test_a_span_is_a_view_of_the_pool():
    cache = torch.randn(8, 4, 2, 3)
    rows = gather_rows(cache, slice(9, 14))
    assert rows.data_ptr() == cache.flatten(0, 1)[9].data_ptr()
    assert torch.equal(rows, cache.flatten(0, 1)[9:14])


def test_attention_over_a_span_has_the_gathers_bits():
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        k_cache = torch.randn(12, 16, 3, 64, generator=gen).to(dtype)
        v_cache = torch.randn(12, 16, 3, 64, generator=gen).to(dtype)
        q = torch.randn(1, 9, 64, generator=gen).to(dtype)
        lone = _Step([4, 5, 6, 7], 53)
        assert isinstance(_context_rows(lone, 0, 16), slice)
        out = paged_attention(q, k_cache, v_cache, lone, 0.125)
        # the same rows through a gathered (non-consecutive) table
        moved_k, moved_v = k_cache.clone(), v_cache.clone()
        for src, dst in ((4, 9), (5, 2), (6, 11), (7, 0)):
            moved_k[dst], moved_v[dst] = k_cache[src], v_cache[src]
        gathered = _Step([9, 2, 11, 0], 53)
        assert isinstance(_context_rows(gathered, 0, 16), torch.Tensor)
        assert torch.equal(out, paged_attention(q, moved_k, moved_v, gathered, 0.125))
