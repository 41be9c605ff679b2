"""Fused MoE (interpreter) against the per-expert torch reference and dgpp.nn's FusedExperts."""

from __future__ import annotations

import pytest
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


def _expected_layout(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The alignment spelled out: each expert's assignments in index order, padded with ``n`` to whole
    blocks, experts in order; each block's expert, -1 past the used blocks."""
    flat = ids.flatten().tolist()
    n = len(flat)
    rows: list[int] = []
    experts: list[int] = []
    for e in range(num_experts):
        mine = [i for i, x in enumerate(flat) if x == e]
        padded = -(-len(mine) // block_m) * block_m
        rows += mine + [n] * (padded - len(mine))
        experts += [e] * (padded // block_m)
    return rows, experts


@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m",
    [(1, 8, 2, 16), (7, 6, 2, 4), (33, 64, 8, 16), (40, 4, 2, 64), (5, 1, 1, 16)],
)
def test_align_layout_is_exact_with_a_fixed_shape_expert_count(tokens, experts, top_k, block_m) -> None:
    """Expert counts come from a scatter into a preallocated [E] tensor (torch.bincount sizes its output from
    the data: a host sync that CUDA-graph capture refuses); the layout must be exactly the spelled-out one."""
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    sorted_ids, block_expert = align_to_experts(ids, experts, block_m)
    rows, owners = _expected_layout(ids, experts, block_m)
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    assert sorted_ids[: len(rows)].tolist() == rows and sorted_ids[len(rows) :].eq(ids.numel()).all()
    assert block_expert[: len(owners)].tolist() == owners and block_expert[len(owners) :].eq(-1).all()
    assert sorted_ids.numel() == block_expert.numel() * block_m


def test_align_never_calls_bincount(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("torch.bincount syncs with the host; decode graphs cannot capture it")

    monkeypatch.setattr(torch, "bincount", refuse)
    x, gate_up, down, w, ids = _moe_inputs(tokens=3, experts=4, top_k=2, hidden=16, inter=8, seed=4)
    align_to_experts(ids, 4, 16)
    torch.testing.assert_close(
        fused_moe_triton(x, gate_up, down, w, ids),
        fused_moe_ref(x, gate_up, down, w, ids),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with TRITON_INTERPRET=0)")
def test_fused_moe_is_captured_in_a_cuda_graph() -> None:
    """A captured fused MoE replays new routings (copied into its static inputs) bit-identically to eager."""
    x, gate_up, down, w, ids = (
        t.cuda() for t in _moe_inputs(tokens=4, experts=8, top_k=2, hidden=64, inter=32, seed=5)
    )
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the MoE raises
    try:
        fused_moe_triton(x, gate_up, down, w, ids)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe_triton(x, gate_up, down, w, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (6, 7):
        x2, _, _, w2, ids2 = (
            t.cuda() for t in _moe_inputs(tokens=4, experts=8, top_k=2, hidden=64, inter=32, seed=seed)
        )
        for static, new in ((x, x2), (w, w2), (ids, ids2)):
            static.copy_(new)
        graph.replay()
        assert torch.equal(out, fused_moe_triton(x2, gate_up, down, w2, ids2))


def test_fused_moe_matches_reference() -> None:
    x, gate_up, down, w, ids = _moe_inputs(tokens=7, experts=6, top_k=2, hidden=48, inter=40, seed=0)
    torch.testing.assert_close(
        fused_moe_triton(x, gate_up, down, w, ids),
        fused_moe_ref(x, gate_up, down, w, ids),
        rtol=1e-4,
        atol=1e-5,
    )


def test_fused_moe_many_tokens_uses_large_blocks() -> None:
    x, gate_up, down, w, ids = _moe_inputs(tokens=40, experts=4, top_k=2, hidden=32, inter=16, seed=1)
    torch.testing.assert_close(
        fused_moe_triton(x, gate_up, down, w, ids),
        fused_moe_ref(x, gate_up, down, w, ids),
        rtol=1e-4,
        atol=1e-5,
    )


def test_a_prompt_takes_the_wide_tile_with_the_default_tiles_bits(monkeypatch) -> None:
    """From ``PREFILL_ASSIGNMENTS`` (token x top-k) on, both grouped GEMMs launch ``PREFILL_TILE`` (128-wide
    outputs); every row keeps the bits the default tile gives it (one accumulator fed in K order), and the values
    are the reference's."""
    import dgpp.kernels.moe as moe

    widths = []
    launch = moe._grouped_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                widths.append(kwargs["BN"])
                return launch[grid](*args, **kwargs)

            return run

    x, gate_up, down, w, ids = _moe_inputs(tokens=256, experts=8, top_k=4, hidden=128, inter=128, seed=3)
    assert (
        x.shape[0] * ids.shape[1] >= moe.PREFILL_ASSIGNMENTS // 4
    )  # the threshold lowered to fit a CPU test
    monkeypatch.setattr(moe, "PREFILL_ASSIGNMENTS", x.shape[0] * ids.shape[1])
    monkeypatch.setattr(moe, "_grouped_gemm_kernel", Spy())
    wide = fused_moe_triton(x, gate_up, down, w, ids)
    assert widths == [moe.PREFILL_TILE[0]] * 2
    default = fused_moe_triton(x, gate_up, down, w, ids, tile=moe.DEFAULT_TILE)
    assert widths[2:] == [moe.DEFAULT_TILE[0]] * 2
    assert torch.equal(wide, default)
    torch.testing.assert_close(wide, fused_moe_ref(x, gate_up, down, w, ids), rtol=1e-4, atol=1e-5)


def test_reference_matches_nn_fused_experts() -> None:
    from dgpp.nn.moe import FusedExperts

    x, gate_up, down, w, ids = _moe_inputs(tokens=5, experts=4, top_k=2, hidden=16, inter=8, seed=2)
    experts = FusedExperts(4, 16, 8, dtype=torch.float32)
    experts.gate_up_proj.data.copy_(gate_up)
    experts.down_proj.data.copy_(down)
    torch.testing.assert_close(
        fused_moe_ref(x, gate_up, down, w, ids), experts(x, w, ids), rtol=1e-5, atol=1e-5
    )


def test_fused_moe_clamps_swiglu_inputs_like_the_reference() -> None:
    """DeepSeek-V4's limit: gate <= 10, |up| <= 10 before silu(gate) * up; weights large enough to cross it."""
    x, gate_up, down, weights, ids = _moe_inputs(6, 8, 2, 32, 16, seed=5)
    gate_up = gate_up * 15
    assert (x @ gate_up[0].T).abs().max() > 10
    want = fused_moe_ref(x, gate_up, down, weights, ids, swiglu_limit=10.0)
    got = fused_moe_triton(x, gate_up, down, weights, ids, swiglu_limit=10.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    unclamped = fused_moe_triton(x, gate_up, down, weights, ids)
    assert (unclamped - want).abs().max() > 1e-2
    with pytest.raises(ValueError, match="swiglu_limit"):
        fused_moe_triton(x, gate_up, down, weights, ids, swiglu_limit=0.0)


def test_expert_sum_kernel_gives_the_chain_bits() -> None:
    # fp32 out: the interpreter rounds fp32 -> bf16 its own way
    from dgpp.kernels.moe import _sum_experts_kernel, sum_experts_ref

    dtype = torch.float32
    g = torch.Generator().manual_seed(3)
    per_token = torch.randn(3, 8, 80, generator=g) * torch.logspace(-3, 3, 8)[None, :, None]  # order matters
    out = torch.empty(3, 80, dtype=dtype)
    strides = (per_token.stride(0), per_token.stride(1))
    _sum_experts_kernel[(3, 2)](per_token, out, out, 8, 80, *strides, 0, 80, ADD=False, BLOCK=64)
    assert torch.equal(out, sum_experts_ref(per_token, dtype))
    assert not torch.equal(sum_experts_ref(per_token[:, :7], dtype), out)  # every expert counts
    # a shared expert's output added in the same launch: the chain's `sum + shared`, bit for bit
    shared = torch.randn(3, 80, generator=g) * 100
    summed = torch.empty(3, 80, dtype=dtype)
    _sum_experts_kernel[(3, 2)](per_token, shared, summed, 8, 80, *strides, 80, 80, ADD=True, BLOCK=64)
    assert torch.equal(summed, sum_experts_ref(per_token, dtype, shared))
    assert torch.equal(summed, sum_experts_ref(per_token, dtype) + shared) and not torch.equal(summed, out)


def test_shared_expert_added_in_the_sum_launch_on_the_cuda_branch() -> None:
    """An ungated shared expert's output joins the routed experts' sum launch on the CUDA branch (no add of its
    own), with the bits of the separate add."""
    from collections import Counter

    from dgpp.bench.launches import cuda_path
    from dgpp.nn.moe import RoutingConfig, SparseMoE

    g = torch.Generator().manual_seed(4)
    routing = RoutingConfig(num_experts=16, top_k=2, scoring="sigmoid")
    moe = SparseMoE(32, 16, routing, dtype=torch.float32, shared_intermediate_size=16)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(3, 32, generator=g)
    with cuda_path() as recorder:
        recorder.target = launches = Counter()
        fused = moe(x)
        recorder.target = None
        weights, ids = moe.gate(x)
        routed = moe.experts(x, weights, ids)
        separate = routed + moe.shared_expert(x)
    assert launches["sum_experts"] == 1 and "aten.add" not in launches, dict(launches)
    assert torch.equal(fused, separate) and not torch.equal(fused, routed)
