"""Varlen causal prefill attention over paged K/V (interpreter) against the torch reference and dgpp.nn's path."""

from __future__ import annotations

import torch

from dgpp.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton


def _setup(ctx: list[int], rows: list[int], hq: int, hk: int, dim: int, bs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-(c + r) // bs) for c, r in zip(ctx, rows, strict=True)]
    num_blocks = sum(per_seq) + 2
    k_cache = torch.randn(num_blocks, bs, hk, dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, hk, dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(ctx), max(per_seq)), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[used : used + n].int()
        used += n
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(rows), hq, dim, generator=g)
    return q, k_cache, v_cache, tables, starts, torch.tensor(ctx, dtype=torch.int32)


def test_prefill_attention_matches_reference_with_chunks_and_gqa() -> None:
    q, kc, vc, bt, starts, ctx = _setup([0, 5, 20], [7, 70, 3], 4, 2, 16, 4, seed=0)
    out = prefill_attention_triton(q, kc, vc, bt, starts, ctx, 0.25, block_m=32)
    torch.testing.assert_close(
        out, prefill_attention_ref(q, kc, vc, bt, starts, ctx, 0.25), rtol=1e-4, atol=1e-5
    )


def test_reference_matches_nn_attention_torch_path() -> None:
    from dgpp.nn.attention import paged_attention
    from dgpp.step.batch import ForwardBatch

    ctx, rows = [0, 6], [5, 4]
    q, kc, vc, bt, starts, ctx_t = _setup(ctx, rows, 4, 2, 16, 4, seed=1)
    seq = [c + r for c, r in zip(ctx, rows, strict=True)]
    batch = ForwardBatch(
        input_ids=torch.zeros(9, dtype=torch.long),
        positions=torch.zeros(9, dtype=torch.long),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        context_lens=ctx_t,
        block_tables=bt,
        slot_mapping=torch.full((9,), -1),
        state_slots=torch.zeros(2, dtype=torch.long),
        logits_indices=torch.tensor([4, 8]),
        cache=None,
        q_lens_cpu=rows,
        seq_lens_cpu=seq,
        context_lens_cpu=ctx,
    )
    ref = prefill_attention_ref(q, kc, vc, bt, starts, ctx_t, 0.25)
    torch.testing.assert_close(ref, paged_attention(q, kc, vc, batch, 0.25), rtol=1e-5, atol=1e-5)


def test_prefill_attention_tiles_agree() -> None:
    """Every tile of the GPU sweep computes the same attention (BLOCK_N splits the unmasked/causal loops
    differently; BLOCK_M moves the diagonal)."""
    q, kc, vc, bt, starts, ctx = _setup([0, 37, 3], [50, 20, 1], 4, 1, 16, 8, seed=2)
    ref = prefill_attention_ref(q, kc, vc, bt, starts, ctx, 0.25)
    for tile in ((16, 16, 4, 2), (32, 16, 4, 2), (16, 32, 4, 2), (64, 64, 4, 2)):
        out = prefill_attention_triton(q, kc, vc, bt, starts, ctx, 0.25, tile=tile)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=f"tile {tile}")


def test_host_lists_give_the_same_attention() -> None:
    """The engine hands the query starts and context lengths over as host lists (no device read per layer):
    the same block plan, so the same bits."""
    q, kc, vc, bt, starts, ctx = _setup([0, 9, 30], [40, 17, 2], 4, 2, 16, 4, seed=3)
    read = prefill_attention_triton(q, kc, vc, bt, starts, ctx, 0.25, block_m=16)
    given = prefill_attention_triton(
        q, kc, vc, bt, starts, ctx, 0.25, block_m=16, host=(starts.tolist(), ctx.tolist())
    )
    assert torch.equal(read, given)
