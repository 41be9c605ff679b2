"""The one-launch expert alignment (interpreter) equals dgpp.kernels.moe.align_to_experts exactly."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.moe import align_to_experts
from dgpp.kernels.moe_align import align_to_experts_triton, fits


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(1, 8, 256, 16), (3, 2, 8, 16), (64, 8, 256, 16), (128, 8, 256, 16), (7, 4, 5, 4), (2, 1, 1, 16)],
)
def test_same_layout_as_the_torch_alignment(tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    ids = torch.randn(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    want = align_to_experts(ids, experts, block_m)
    got = align_to_experts_triton(ids, experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_experts_spanning_several_blocks():
    """Many assignments on few experts: runs longer than a block, padding inside the last one."""
    ids = torch.randint(0, 3, (40, 2), generator=torch.Generator().manual_seed(1))
    for block_m in (4, 16, 64):
        want = align_to_experts(ids, 8, block_m)
        got = align_to_experts_triton(ids, 8, block_m)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert fits(ids, 8) and not fits(torch.zeros(129, 8, dtype=torch.long), 8)
