"""Prompt rows of a full-attention layer, four rows of a sequence a program (``dgpp.kernels.full_attention_rows``,
interpreter, fp32): bit for bit the one-row window kernel's output, whatever the blocks, the chunking or the
sequences beside them."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels import full_attention_rows
from dgpp.kernels.full_attention_rows import ROWS, prompt_row_blocks
from dgpp.kernels.window_attention import window_attention_ref, window_attention_triton

HQ, HK, BS, DIM, V_DIM = 6, 2, 4, 48, 32


def _pool(seed: int):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(60, BS, HK, DIM, generator=g)
    v_cache = torch.randn(60, BS, HK, V_DIM, generator=g)
    tables = torch.randperm(60, generator=g)[:54].view(3, 18).int()
    return k_cache, v_cache, tables, torch.randn(HQ, generator=g)


def _attend(q, ctx: list[int], q_lens: list[int], pool, sinks: bool, blocks: bool, lens=None):
    k_cache, v_cache, tables, sink = pool
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    if lens is None:
        lens = torch.tensor([c + n for c, n in zip(ctx, q_lens, strict=True)], dtype=torch.int32)
    args = (
        q,
        None,
        None,
        k_cache,
        v_cache,
        tables[: len(q_lens)],
        starts,
        torch.tensor(ctx, dtype=torch.int32),
        lens,
        sink if sinks else None,
        0.3,
        0,
        True,
    )
    if not blocks:
        return window_attention_triton(*args), window_attention_ref(*args)
    shared = full_attention_rows.full_attention_rows_triton(
        *args[:1], *args[3:10], 0.3, prompt_row_blocks(q_lens, q.device)
    )
    return shared, window_attention_ref(*args)


@pytest.mark.parametrize("sinks", [True, False])
def test_rows_sharing_key_tiles_equal_the_one_row_kernel(sinks: bool) -> None:
    """Three prompts (one mid-sequence, lengths not a multiple of four, one row alone) against the one-row
    kernel bit for bit, and against the reference."""
    ctx, q_lens = [61, 0, 5], [10, 7, 1]
    q = torch.randn(sum(q_lens), HQ, DIM, generator=torch.Generator().manual_seed(2))
    pool = _pool(3)
    shared, ref = _attend(q, ctx, q_lens, pool, sinks, blocks=True)
    alone, _ = _attend(q, ctx, q_lens, pool, sinks, blocks=False)
    assert torch.equal(shared, alone)
    torch.testing.assert_close(shared, ref, rtol=1e-5, atol=1e-5)


def test_wide_heads_are_refused() -> None:
    """Heads over 256 wide split their query heads in the one-row kernel: not a shape this kernel takes."""
    q = torch.zeros(2, 4, 320)
    cache = torch.zeros(3, BS, 1, 320)
    assert not full_attention_rows.takes_rows(q, cache)
    assert full_attention_rows.takes_rows(q[..., :192], cache[..., :128])
    with pytest.raises(ValueError, match="320/320"):
        full_attention_rows.full_attention_rows_triton(
            q,
            cache,
            cache,
            torch.zeros(1, 3, dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            torch.full((1,), 2, dtype=torch.int32),
            None,
            1.0,
            torch.zeros(1, dtype=torch.int32),
        )


def test_a_prompt_cut_into_chunks_gets_the_one_shot_bits() -> None:
    """A 22-row prompt at once, and as chunks of 9 and 13 rows (the second over the first's stored keys): every row
    the same bits, though its four-row block differs."""
    pool = _pool(5)
    q = torch.randn(22, HQ, DIM, generator=torch.Generator().manual_seed(6))
    whole, _ = _attend(q, [0], [22], pool, True, blocks=True)
    first, _ = _attend(q[:9], [0], [9], pool, True, blocks=True)
    second, _ = _attend(q[9:], [9], [13], pool, True, blocks=True)
    assert torch.equal(torch.cat([first, second]), whole)


def test_a_sequence_that_walks_no_keys_gets_zeros() -> None:
    """A decode row's sequence zeroed for the launch (``seq_lens`` 0, as a mixed step does): its rows are zeros,
    the prompt beside it unchanged."""
    pool = _pool(7)
    q = torch.randn(9, HQ, DIM, generator=torch.Generator().manual_seed(8))
    lens = torch.tensor([0, 8], dtype=torch.int32)
    shared, _ = _attend(q, [20, 0], [1, 8], pool, True, blocks=True, lens=lens)
    alone, _ = _attend(q, [20, 0], [1, 8], pool, True, blocks=False, lens=lens)
    assert float(shared[0].abs().max()) == 0.0
    assert torch.equal(shared, alone)


def test_blocks_start_at_each_prompt_and_never_straddle_two() -> None:
    blocks = prompt_row_blocks([10, 1, 4, 0, 5], torch.device("cpu")).tolist()
    assert ROWS == 4 and blocks == [0, 4, 8, 10, 11, 15, 19]
