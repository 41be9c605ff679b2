"""``build_batch`` builds positions and slot_mapping with tensor ops: bit-identical to the per-token loop it
replaced, on random varlen batches (prefill chunks and decode rows mixed, scattered blocks, ragged tables)."""

from __future__ import annotations

import random

import pytest
import torch

from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.step.pools import CachePools


def loop_reference(work: list[SeqWork], block_size: int) -> dict[str, list]:
    """The per-token loop build_batch used before vectorising (the oracle)."""
    positions, slots, starts, logits_rows = [], [], [0], []
    for w in work:
        for pos in range(w.context_len, w.context_len + len(w.token_ids)):
            positions.append(pos)
            slots.append(w.block_table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + len(w.token_ids))
        if w.want_logits:
            logits_rows.append(starts[-1] - 1)
    width = max(len(w.block_table) for w in work)
    tables = [w.block_table + [-1] * (width - len(w.block_table)) for w in work]
    return {
        "positions": positions,
        "slot_mapping": slots,
        "query_start_loc": starts,
        "logits_indices": logits_rows,
        "block_tables": tables,
        "input_ids": [t for w in work for t in w.token_ids],
    }


def random_work(rng: random.Random, num_blocks: int, block_size: int) -> list[SeqWork]:
    """Mixed prefill/decode items over scattered (shuffled, non-contiguous) blocks; some tables have spare
    blocks past what the step needs, so the padded tensor has -1 rows of different lengths."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    work = []
    for slot in range(rng.randint(1, 7)):
        ctx = rng.choice([0, 0, rng.randint(0, 60)])
        n = 1 if rng.random() < 0.5 else rng.randint(1, 40)
        need = (ctx + n + block_size - 1) // block_size + rng.randint(0, 2)
        if need > len(free):
            break
        table, free = free[:need], free[need:]
        tokens = [rng.randint(0, 511) for _ in range(n)]
        work.append(SeqWork(slot, table, ctx, tokens, want_logits=rng.random() < 0.8))
    return work or [SeqWork(0, [free[0]], 0, [1])]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_vectorised_build_equals_the_token_loop(block_size: int) -> None:
    rng = random.Random(block_size)
    num_blocks = 400 // block_size + 8
    pools = CachePools({}, num_blocks=num_blocks, block_size=block_size, num_state_slots=8)
    seen_mixed = seen_padding = False
    for _ in range(60):
        work = random_work(rng, num_blocks, block_size)
        batch = build_batch(work, pools)
        ref = loop_reference(work, block_size)
        for name, expected in ref.items():
            got = getattr(batch, name)
            assert got.tolist() == expected, name
        assert batch.positions.dtype == batch.slot_mapping.dtype == batch.logits_indices.dtype == torch.int64
        assert batch.query_start_loc.dtype == batch.block_tables.dtype == torch.int32
        assert batch.seq_lens.tolist() == [w.context_len + len(w.token_ids) for w in work]
        seen_mixed |= len({len(w.token_ids) == 1 for w in work}) == 2
        seen_padding |= bool(batch.block_tables.eq(-1).any())
    assert seen_mixed and seen_padding  # the random batches did exercise both cases


def test_errors_name_the_first_bad_item() -> None:
    pools = CachePools({}, num_blocks=8, block_size=4, num_state_slots=2)
    good = SeqWork(0, [1], 0, [5])
    with pytest.raises(ValueError, match="work item 1 has no tokens"):
        build_batch([good, SeqWork(1, [2], 0, [])], pools)
    with pytest.raises(ValueError, match=r"work item 1: block ids \[3, 9\] outside the pool's 0..7"):
        build_batch([good, SeqWork(1, [3, 9], 0, [1, 2, 3, 4, 5])], pools)
    with pytest.raises(ValueError, match="work item 0: block ids .* outside"):
        build_batch([SeqWork(0, [2**40], 0, [1])], pools)
    with pytest.raises(ValueError, match="work item 0: block ids .* outside"):
        build_batch([SeqWork(0, [-1], 0, [1])], pools)
