"""The compressed cache kinds: ``CompressedKV`` (entries in the paged pool, one per ``ratio`` tokens, in the block of
their window's last token) and ``WindowBuffer`` (a per-request ring of the rows not pooled yet)."""

from __future__ import annotations

import pytest
import torch

from dgpp.nn.window_compressor import entry_slots
from dgpp.plugin_api import CompressedKV, WindowBuffer
from dgpp.step.memory import cache_rates
from dgpp.step.pools import CachePools


def test_pool_rows_per_block_and_plan_bytes() -> None:
    csa, hca = CompressedKV.of(4, 512, torch.bfloat16), CompressedKV.of(128, 512, torch.bfloat16)
    assert (csa.rows_per_block(16), hca.rows_per_block(16), hca.rows_per_block(256)) == (4, 1, 2)
    with pytest.raises(ValueError, match="divide"):
        CompressedKV.of(8, 64, torch.float32).rows_per_block(12)
    # the plan counts the pool as the default 16-token blocks allocate it
    assert (csa.bytes_per_token(), hca.bytes_per_token()) == (256, 64)
    buffer = WindowBuffer(rows=8, width=1024, dtype=torch.bfloat16)
    assert buffer.tensors == {"kv": ((8, 1024), torch.bfloat16), "gate": ((8, 1024), torch.bfloat16)}
    assert cache_rates({"a": csa, "b": buffer}) == (256, 2 * 8 * 1024 * 2)
    with pytest.raises(ValueError):
        WindowBuffer(rows=0, width=4)


def test_pools_hold_entries_in_the_block_of_their_last_token() -> None:
    spec = {"c": CompressedKV.of(8, 4, torch.float32), "h": CompressedKV.of(32, 4, torch.float32)}
    pools = CachePools(spec, num_blocks=6, block_size=16, num_state_slots=1)
    assert pools.kv["c"][0].shape == (6, 2, 1, 4) and pools.kv["c"][1].shape == (6, 2, 1, 0)
    assert pools.kv["h"][0].shape == (6, 1, 1, 4)
    table = torch.tensor([5, 3, 0, 2])
    # ratio 8: entries 0..3 end at tokens 7, 15, 23, 31 -> blocks 5, 5, 3, 3, rows 0, 1, 0, 1
    assert entry_slots(table, torch.arange(4), 8, 16, 2).tolist() == [10, 11, 6, 7]
    # ratio 32: entries end at tokens 31, 63 -> blocks 3 and 2, one row each
    assert entry_slots(table, torch.arange(2), 32, 16, 1).tolist() == [3, 2]
