"""Runner batch building, state-slot reset at sequence start, the block pool and the test slot allocator."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.work import SeqWork
from dgpp.offline import OutOfSlots, SlotAllocator
from dgpp.sched.block_pool import BlockPool, OutOfBlocks
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import CacheSpec, StateSpec
from dgpp.step.model import Model, ModelInfo
from dgpp.step.pools import CachePools


def test_build_batch_positions_slots_and_logit_rows():
    pools = CachePools({}, num_blocks=8, block_size=4, num_state_slots=2)
    work = [
        SeqWork(1, [5, 2], 3, [10, 11, 12]),
        SeqWork(0, [7], 2, [13], want_logits=False),
        SeqWork(0, [3, 4], 4, [14]),
    ]
    b = build_batch(work, pools)
    assert b.positions.tolist() == [3, 4, 5, 2, 4]
    assert b.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 7 * 4 + 2, 4 * 4 + 0]
    assert b.query_start_loc.tolist() == [0, 3, 4, 5] and b.seq_lens.tolist() == [6, 3, 5]
    assert b.logits_indices.tolist() == [2, 4]
    assert b.block_tables.tolist() == [[5, 2], [7, -1], [3, 4]]
    assert b.state_slots.tolist() == [1, 0, 0] and not b.is_decode_only


def test_short_block_table_is_refused():
    pools = CachePools({}, num_blocks=8, block_size=4, num_state_slots=1)
    with pytest.raises(ValueError, match="covers 4 tokens, needs 5"):
        build_batch([SeqWork(0, [1], 3, [1, 2])], pools)
    with pytest.raises(ValueError, match="outside the pool"):
        build_batch([SeqWork(0, [8], 0, [1, 2])], pools)


class RunningSum(Model):
    """A stateful toy: each sequence's state accumulates its token ids; logits row = one-hot of the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.info = ModelInfo(vocab_size=64, max_position=64, hybrid=True)

    def cache_spec(self) -> dict[str, CacheSpec]:
        return {"sum": StateSpec({"total": ((), torch.int64)})}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        total = batch.cache.state["sum"]["total"]
        for i, (start, end) in enumerate(
            zip(batch.query_start_loc[:-1].tolist(), batch.query_start_loc[1:].tolist(), strict=True)
        ):
            total[batch.state_slots[i]] += batch.input_ids[start:end].sum()
        sums = total[batch.state_slots]
        last = (batch.query_start_loc[1:] - 1).tolist()
        keep = [i for i, row in enumerate(last) if row in batch.logits_indices.tolist()]
        return torch.nn.functional.one_hot(sums[keep], 64).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def test_state_slot_is_zeroed_when_a_sequence_starts():
    model = RunningSum()
    pools = CachePools(model.cache_spec(), num_blocks=4, block_size=4, num_state_slots=2)
    runner = ModelRunner(model, pools)
    assert runner.step([SeqWork(0, [0], 0, [1, 2])]).argmax(-1).tolist() == [3]
    assert runner.step([SeqWork(0, [0], 2, [4]), SeqWork(1, [1], 0, [5])]).argmax(-1).tolist() == [7, 5]
    # slot 0 reused by a new sequence: it must start from zero, not from 7
    assert runner.step([SeqWork(0, [2], 0, [6])]).argmax(-1).tolist() == [6]


def test_block_pool_refcounts_and_exhaustion():
    alloc = BlockPool(4, 16)
    a = alloc.allocate(3)
    alloc.incref(a[0])
    for block in a:
        alloc.decref(block)
    assert alloc.num_free == 3  # a[0] still held once
    alloc.decref(a[0])
    assert alloc.num_free == 4
    with pytest.raises(OutOfBlocks):
        alloc.allocate(5)
    with pytest.raises(RuntimeError, match="free KV block"):
        alloc.decref(a[1])


def test_slot_allocator():
    slots = SlotAllocator(2)
    s0, s1 = slots.allocate(), slots.allocate()
    assert {s0, s1} == {0, 1}
    with pytest.raises(OutOfSlots):
        slots.allocate()
    slots.free(s0)
    with pytest.raises(RuntimeError, match="not allocated"):
        slots.free(s0)
    assert slots.allocate() == s0


class ConstantLogits(Model):
    """Every row gets the same logits, with a tie between ids 3 and 7 for the maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.info = ModelInfo(vocab_size=10, max_position=64, eos_token_ids=(9,))

    def cache_spec(self) -> dict[str, CacheSpec]:
        return {}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return torch.zeros(len(batch.logits_indices), 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        row = torch.tensor([0.0, 1, 2, 5, 0, 0, 0, 5, 0, 4])
        return row.expand(hidden.shape[0], -1)


def test_greedy_ties_go_to_the_lowest_id():
    from dgpp.offline import greedy_generate

    assert greedy_generate(ConstantLogits(), [[1, 2], [4]], 3, chunk_size=1) == [[3, 3, 3], [3, 3, 3]]


def test_generation_past_the_position_limit_is_refused():
    from dgpp.offline import greedy_generate

    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        greedy_generate(ConstantLogits(), [[1] * 60], 5)
