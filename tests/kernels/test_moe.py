"""Fused MoE (interpreter) against the per-expert torch reference and dgpp.nn's FusedExperts."""

from __future__ import annotations

import torch

from dgpp.kernels.moe import align_to_experts, fused_moe_ref, fused_moe_triton


def _moe_inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    scores = torch.randn(tokens, experts, generator=gen).softmax(-1)
    weights, ids = scores.topk(top_k, dim=-1)
    return x, gate_up, down, weights, ids


def test_align_puts_each_block_on_one_expert() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]])
    sorted_ids, block_expert = align_to_experts(ids, 5, 4)
    flat = ids.flatten()
    n = flat.numel()
    seen = []
    for blk, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[blk * 4 : blk * 4 + 4].tolist()
        real = [r for r in rows if r < n]
        if expert < 0:
            assert not real
        assert all(int(flat[r]) == expert for r in real)
        seen += real
    assert sorted(seen) == list(range(n))


def test_fused_moe_matches_reference() -> None:
    x, gate_up, down, w, ids = _moe_inputs(tokens=7, experts=6, top_k=2, hidden=48, inter=40, seed=0)
    torch.testing.assert_close(fused_moe_triton(x, gate_up, down, w, ids), fused_moe_ref(x, gate_up, down, w, ids),
                               rtol=1e-4, atol=1e-5)


def test_fused_moe_many_tokens_uses_large_blocks() -> None:
    x, gate_up, down, w, ids = _moe_inputs(tokens=40, experts=4, top_k=2, hidden=32, inter=16, seed=1)
    torch.testing.assert_close(fused_moe_triton(x, gate_up, down, w, ids), fused_moe_ref(x, gate_up, down, w, ids),
                               rtol=1e-4, atol=1e-5)


def test_reference_matches_nn_fused_experts() -> None:
    from dgpp.nn.moe import FusedExperts

    x, gate_up, down, w, ids = _moe_inputs(tokens=5, experts=4, top_k=2, hidden=16, inter=8, seed=2)
    experts = FusedExperts(4, 16, 8, dtype=torch.float32)
    experts.gate_up_proj.data.copy_(gate_up)
    experts.down_proj.data.copy_(down)
    torch.testing.assert_close(fused_moe_ref(x, gate_up, down, w, ids), experts(x, w, ids), rtol=1e-5, atol=1e-5)
