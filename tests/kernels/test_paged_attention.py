"""Paged decode attention: Triton (interpreter) against the torch reference and plain SDPA."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.paged_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    plan_partition,
)


def _paged_setup(
    seq_lens: list[int], hq: int, hk: int, dim: int, block_size: int, num_blocks: int, seed: int
):
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_blocks = num_blocks // batch
    k_cache = torch.randn(num_blocks, block_size, hk, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hk, dim, generator=g)
    # scattered, non-contiguous blocks per sequence
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = -(-n // block_size)
        tables[b, :used] = perm[b * max_blocks : b * max_blocks + used].int()
    q = torch.randn(batch, hq, dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize(("hq", "hk"), [(4, 2), (4, 4), (6, 1)])
def test_decode_attention_matches_reference(hq: int, hk: int) -> None:
    q, kc, vc, bt, lens = _paged_setup([1, 37, 12, 64], hq, hk, 32, 8, 64, seed=hq * 10 + hk)
    out = paged_decode_attention_triton(q, kc, vc, bt, lens, 0.17)
    torch.testing.assert_close(
        out, paged_decode_attention_ref(q, kc, vc, bt, lens, 0.17), rtol=1e-4, atol=1e-5
    )


def test_split_context_matches_reference() -> None:
    # one sequence, long table: several partitions merged by the second kernel
    q, kc, vc, bt, lens = _paged_setup([300], 4, 2, 16, 4, 128, seed=5)
    part, splits = plan_partition(1, 2, bt.shape[1] * 4)
    assert splits > 1 and part * splits >= 300
    out = paged_decode_attention_triton(q, kc, vc, bt, lens, 0.25)
    torch.testing.assert_close(
        out, paged_decode_attention_ref(q, kc, vc, bt, lens, 0.25), rtol=1e-4, atol=1e-5
    )


def test_padding_rows_are_zero_and_window_limits_context() -> None:
    q, kc, vc, bt, lens = _paged_setup([0, 40, 200], 2, 1, 16, 4, 150, seed=7)
    out = paged_decode_attention_triton(q, kc, vc, bt, lens, 0.3, window=24)
    ref = paged_decode_attention_ref(q, kc, vc, bt, lens, 0.3, window=24)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    full = paged_decode_attention_ref(q, kc, vc, bt, lens, 0.3)
    assert not torch.allclose(full[2], ref[2])


def test_reference_matches_sdpa_on_contiguous_cache() -> None:
    q, kc, vc, bt, lens = _paged_setup([19], 4, 2, 16, 4, 8, seed=11)
    out = paged_decode_attention_ref(q, kc, vc, bt, lens, 16**-0.5)
    tok = torch.arange(19)
    k = kc[bt[0, tok // 4].long(), tok % 4].repeat_interleave(2, 1).transpose(0, 1)  # [H, L, D]
    v = vc[bt[0, tok // 4].long(), tok % 4].repeat_interleave(2, 1).transpose(0, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[0][:, None], k, v)[:, 0]
    torch.testing.assert_close(out[0], sdpa, rtol=1e-5, atol=1e-5)


def test_kv_write_skips_padding_slots() -> None:
    from dgpp.kernels.kv_write import write_kv_ref, write_kv_triton

    g = torch.Generator().manual_seed(13)
    kc, vc = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 8, generator=g)
    k, v = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([3, -1, 17, 0, 23])
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_triton(kc, vc, k, v, slots)
    write_kv_ref(kc2, vc2, k, v, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(kc.view(-1, 2, 16)[17], k[2])


def test_each_sequence_spreads_its_own_context_over_the_splits() -> None:
    """Wide tables (the graph's capture-time width) with short and long contexts in one batch: rows of at most
    one 64-token step are answered by split 0 alone (no merge), longer ones spread over as many splits as
    they need; every row matches the reference, windowed or not."""
    lens = [3, 64, 65, 0, 300, 129]
    q, kc, vc, bt, seq = _paged_setup(lens, 4, 2, 16, 4, 6 * 80, seed=17)
    _, splits = plan_partition(len(lens), 2, bt.shape[1] * 4)
    assert splits > 1
    for window in (0, 70):
        out = paged_decode_attention_triton(q, kc, vc, bt, seq, 0.2, window=window)
        ref = paged_decode_attention_ref(q, kc, vc, bt, seq, 0.2, window=window)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_split_count_does_not_change_a_short_row() -> None:
    """A context that fits one step gives the same result whatever the table width (grid split count)."""
    q, kc, vc, bt, seq = _paged_setup([40], 4, 1, 16, 4, 200, seed=19)
    wide = paged_decode_attention_triton(q, kc, vc, bt, seq, 0.25)
    narrow = paged_decode_attention_triton(q, kc, vc, bt[:, :10].contiguous(), seq, 0.25)
    assert plan_partition(1, 1, bt.shape[1] * 4)[1] > 1 == plan_partition(1, 1, 40)[1]
    assert torch.equal(wide, narrow)


def test_programs_per_row_do_not_change_the_bits() -> None:
    """The context's cut follows ``splits``; how many programs compute the splits (``grid_splits``) does not
    change a bit, padding rows included (exact decode attention sizes the grid by the batch)."""
    from dgpp.kernels.paged_attention import decode_attention_with_splits

    lens = [3, 64, 65, 0, 300, 129]
    q, kc, vc, bt, seq = _paged_setup(lens, 4, 2, 16, 4, 6 * 80, seed=23)
    full = decode_attention_with_splits(q, kc, vc, bt, seq, 0.2, 0, 8)
    torch.testing.assert_close(
        full, paged_decode_attention_ref(q, kc, vc, bt, seq, 0.2), rtol=1e-4, atol=1e-5
    )
    for grid in (1, 3, 5):
        assert torch.equal(decode_attention_with_splits(q, kc, vc, bt, seq, 0.2, 0, 8, grid), full)


def test_token_lists_attend_exactly_their_tokens_and_rows_keep_their_bits() -> None:
    """``positions``: each row attends the tokens its list names (a sparse selection; ``seq_lens`` are the counts),
    cut into splits as a context of that many tokens is. The same bits solo and batched; a padding row is zeros."""
    from dgpp.kernels.paged_attention import decode_attention_with_splits

    q, kc, vc, bt, lens = _paged_setup([150, 90, 0, 200], 4, 2, 16, 4, 256, seed=11)
    g = torch.Generator().manual_seed(12)
    counts = torch.tensor([70, 23, 0, 64], dtype=torch.int32)
    positions = torch.zeros(4, 70, dtype=torch.int32)
    for b, (n, c) in enumerate(zip(lens.tolist(), counts.tolist(), strict=True)):
        if c:
            positions[b, :c] = torch.randperm(n, generator=g)[:c].sort().values.int()
    out = decode_attention_with_splits(q, kc, vc, bt, counts, 0.25, 0, 4, positions=positions)
    ref = paged_decode_attention_ref(q, kc, vc, bt, counts, 0.25, positions=positions)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # the list matters: every visible token, or the first `count` of them, give other answers
    for other in (lens, counts):
        unlisted = paged_decode_attention_ref(q, kc, vc, bt, other, 0.25)
        assert not torch.allclose(unlisted[0], out[0], rtol=1e-3, atol=1e-3)
    for b in range(4):
        rows = slice(b, b + 1)
        solo = decode_attention_with_splits(
            q[rows], kc, vc, bt[rows], counts[rows], 0.25, 0, 4, positions=positions[rows]
        )
        assert torch.equal(solo[0], out[b]), b
    # a list of every token is the plain decode attention, bit for bit
    every = torch.arange(200, dtype=torch.int32).expand(4, -1).contiguous()
    plain = decode_attention_with_splits(q, kc, vc, bt, lens, 0.25, 0, 4)
    assert torch.equal(decode_attention_with_splits(q, kc, vc, bt, lens, 0.25, 0, 4, positions=every), plain)
