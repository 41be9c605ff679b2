"""The one-launch MoE router (interpreter, fp32) against its torch reference: softmax, sigmoid and sqrt-softplus
scores, plain and group-limited top-k, ties, the bias and the group limit each moving the picks, and per-row independence."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.router_topk import (
    RouterTopKInputs,
    pick_experts,
    router_topk_ref,
    router_topk_triton,
)


def _step(logits, bias, top_k, *, scoring="sigmoid", renormalize=True, scale=2.5, n_group=1, topk_group=1):
    return RouterTopKInputs(
        logits, bias, top_k, scoring, renormalize, scale, torch.float32, n_group, topk_group
    )


def _assert_same(step: RouterTopKInputs) -> tuple[torch.Tensor, torch.Tensor]:
    got_w, got_ids = router_topk_triton(step)
    ref_w, ref_ids = router_topk_ref(step)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-7)
    return got_w, got_ids


@pytest.mark.parametrize(
    ("scoring", "with_bias", "renormalize"),
    [
        ("softmax", False, True),
        ("sigmoid", True, True),
        ("softmax", False, False),
        ("sqrtsoftplus", True, True),
        ("sqrtsoftplus", False, False),
    ],
)
def test_router_topk_matches_the_torch_chain(scoring: str, with_bias: bool, renormalize: bool) -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 40, generator=g) * 3
    bias = torch.randn(40, generator=g) if with_bias else None  # the bias moves the choice, not the weights
    _, ids = _assert_same(_step(logits, bias, 6, scoring=scoring, renormalize=renormalize))
    if with_bias:
        assert not torch.equal(router_topk_ref(_step(logits, None, 6, scoring=scoring))[1], ids)


def test_router_topk_takes_the_lowest_expert_among_equal_choices() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    step = _step(logits, None, 4, scoring="softmax")
    assert router_topk_triton(step)[1].tolist() == [[1, 3, 4, 2]]
    assert router_topk_ref(step)[1].tolist() == [[1, 3, 4, 2]]


# (experts, n_group, topk_group, top_k): DeepSeek-V3's shape, GLM's tiny one, groups of a non-power-of-2 size
GROUPINGS = [(256, 8, 4, 8), (16, 4, 2, 4), (48, 4, 3, 6), (40, 5, 1, 3), (12, 3, 2, 5)]


@pytest.mark.parametrize(("experts", "n_group", "topk_group", "top_k"), GROUPINGS)
@pytest.mark.parametrize(
    ("scoring", "with_bias"),
    [("sigmoid", True), ("softmax", True), ("softmax", False), ("sqrtsoftplus", True)],
)
def test_grouped_router_matches_the_torch_reference(
    experts: int, n_group: int, topk_group: int, top_k: int, scoring: str, with_bias: bool
) -> None:
    g = torch.Generator().manual_seed(experts + n_group)
    logits = torch.randn(9, experts, generator=g) * 2
    bias = torch.randn(experts, generator=g) * 0.5 - 0.3 if with_bias else None  # mostly negative
    _, ids = _assert_same(_step(logits, bias, top_k, scoring=scoring, n_group=n_group, topk_group=topk_group))
    group_size = experts // n_group
    assert all(len(set((row // group_size).tolist())) <= topk_group for row in ids)


def test_the_group_limit_and_the_bias_each_move_the_picks() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 64, generator=g) * 2
    bias = -torch.rand(64, generator=g)  # negative corrections, as trained routers carry
    step = _step(logits, bias, 6, n_group=8, topk_group=2)
    _, ids = _assert_same(step)
    ungrouped = router_topk_ref(step._replace(n_group=1, topk_group=1))[1]
    unbiased = router_topk_ref(step._replace(bias=None))[1]
    assert not torch.equal(ids, ungrouped) and not torch.equal(ids, unbiased)


def test_a_group_is_scored_by_its_two_best_choices_with_a_bias_else_by_its_best() -> None:
    # group 0 holds the single best expert, group 1 the best pair
    logits = torch.tensor([[4.0, -4.0, 2.0, 2.0]])
    bias = torch.zeros(4)
    pair = _assert_same(_step(logits, bias, 1, n_group=2, topk_group=1))[1]
    best = _assert_same(_step(logits, None, 1, n_group=2, topk_group=1))[1]
    assert pair.tolist() == [[2]] and best.tolist() == [[0]]


def test_ties_go_to_the_lowest_group_and_expert() -> None:
    # every score equal: groups 0 and 1 are kept, then experts 0..3 in order
    flat = _step(torch.zeros(2, 16), torch.zeros(16), 4, n_group=4, topk_group=2)
    assert _assert_same(flat)[1].tolist() == [[0, 1, 2, 3]] * 2
    # groups 1 and 3 tie for the best pair, group 2 holds an equal expert in a weaker pair
    logits = torch.tensor([[0.0, 0.0, 1.0, 3.0, 3.0, -2.0, 1.0, 3.0]])
    tied = _step(logits, torch.zeros(8), 2, n_group=4, topk_group=1)
    assert _assert_same(tied)[1].tolist() == [[3, 2]]
    two_groups = tied._replace(topk_group=2, top_k=3)
    assert _assert_same(two_groups)[1].tolist() == [[3, 7, 2]]
    # a group's two best are equal: its pair is counted once each, as torch's top-2 values are
    twin = _step(torch.tensor([[1.0, 1.0, 0.5, 1.5]]), torch.zeros(4), 2, n_group=2, topk_group=1)
    assert _assert_same(twin)[1].tolist() == [[0, 1]]


def test_the_reference_picks_the_lowest_expert_among_equal_choices() -> None:
    # torch.topk alone may return equal values in any order; the reference pins them as the kernel does
    choice = torch.zeros(3, 256)
    assert pick_experts(choice, 8, 1, 1, pair_sum=False).tolist() == [list(range(8))] * 3
    assert pick_experts(choice, 4, 8, 2, pair_sum=True).tolist() == [list(range(4))] * 3


def test_a_row_routes_the_same_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(7, 48, generator=g)
    bias = torch.randn(48, generator=g) * 0.2
    batched = router_topk_triton(_step(logits, bias, 6, n_group=4, topk_group=2))
    for r in range(7):
        alone = router_topk_triton(_step(logits[r : r + 1].clone(), bias, 6, n_group=4, topk_group=2))
        assert torch.equal(alone[0], batched[0][r : r + 1]) and torch.equal(alone[1], batched[1][r : r + 1])


@pytest.mark.parametrize(
    ("experts", "n_group", "topk_group", "top_k", "message"),
    [(12, 5, 1, 2, "n_group"), (8, 4, 5, 2, "topk_group"), (8, 8, 2, 2, "two best"), (16, 4, 1, 5, "top_k")],
)
def test_shapes_the_kernel_cannot_take_are_named(
    experts: int, n_group: int, topk_group: int, top_k: int, message: str
) -> None:
    step = _step(torch.zeros(1, experts), torch.zeros(experts), top_k, n_group=n_group, topk_group=topk_group)
    with pytest.raises(ValueError, match=message):
        router_topk_triton(step)


def test_sqrt_softplus_scores_keep_their_precision_far_from_zero() -> None:
    # softplus is x itself above 20 and ~exp(x) far below 0, where log(1 + exp(x)) alone would round to 0
    logits = torch.tensor([[-60.0, -30.0, -17.5, -3.0, 0.0, 0.5, 19.9, 20.5, 45.0, -80.0]])
    weights, ids = _assert_same(_step(logits, None, 10, scoring="sqrtsoftplus", renormalize=False, scale=1.0))
    assert ids.tolist() == [[8, 7, 6, 5, 4, 3, 2, 1, 0, 9]]
    torch.testing.assert_close(
        weights, torch.nn.functional.softplus(logits).sqrt()[:, ids[0]], rtol=1e-6, atol=0
    )


def _moe_chain(logits, bias, table, token_ids, top_k, scale):
    """``dgpp.nn.moe``'s torch chain of a DeepSeek-V4 router on ``logits``: learned (``bias``) or hashed."""
    from dgpp.nn.moe import RoutingConfig, picked_weights, router_scores

    cfg = RoutingConfig(logits.shape[1], top_k, "sqrtsoftplus", True, scale, correction_bias=bias is not None)
    scores = router_scores(logits, "sqrtsoftplus")
    if table is not None:
        ids = table[token_ids.long()]
    else:
        ids = pick_experts(scores.float() + bias.float(), top_k, 1, 1, pair_sum=True)
    return picked_weights(scores, ids, cfg, logits.dtype), ids


@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hashed"])
def test_bf16_sqrt_softplus_rounds_as_the_bf16_chain(hashed: bool) -> None:
    """DeepSeek-V4 scores bf16 logits in bf16: the kernel rounds its softplus, root, weight sum, quotient and
    scaled weight to bf16 as the torch chain does; with a 6-way sum in another order the weights are at most one
    bf16 step apart and the picks the same. The scores' rounding and the bias both move the result."""
    g = torch.Generator().manual_seed(23)
    experts, top_k, rows = 64, 6, 32
    logits = (torch.randn(rows, experts, generator=g) * 3).bfloat16()
    bias = None if hashed else torch.randn(experts, generator=g) * 0.05
    table = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(50)]) if hashed else None
    tokens = torch.randint(0, 50, (rows,), generator=g) if hashed else None
    step = RouterTopKInputs(
        logits, bias, top_k, "sqrtsoftplus", True, 1.5, torch.bfloat16, hash_table=table, token_ids=tokens
    )
    got_w, got_ids = router_topk_triton(step)
    want_w, want_ids = _moe_chain(logits, bias, table, tokens, top_k, 1.5)
    ref_w, ref_ids = router_topk_ref(step)
    assert torch.equal(got_ids, want_ids) and torch.equal(ref_ids, want_ids) and torch.equal(ref_w, want_w)
    assert got_w.dtype == torch.bfloat16
    assert ((got_w.float() - want_w.float()).abs() <= 2**-7 * want_w.float().abs()).all()
    assert (got_w == want_w).float().mean() > 0.9
    fp32_w = router_topk_triton(step._replace(logits=logits.float()))[0]
    assert not torch.equal(got_w.float(), fp32_w.float().bfloat16().float())  # the bf16 roundings are taken
    if hashed:
        assert torch.equal(got_ids, table[tokens])
    else:
        assert not torch.equal(router_topk_ref(step._replace(bias=None))[1], got_ids)


def test_hashed_rows_take_their_table_row_alone_and_in_a_batch() -> None:
    """A hash layer's experts are the table's row of the token, in the table's order, whatever the scores; a row's
    weights are the same bits alone and in the batch; a table of the wrong width is named."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 16, generator=g)
    table = torch.tensor([[3, 1, 0], [15, 2, 7], [4, 4, 9]])
    tokens = torch.tensor([1, 0, 2, 1, 0])
    step = _step(logits, None, 3, scoring="sqrtsoftplus")._replace(hash_table=table, token_ids=tokens)
    weights, ids = _assert_same(step)
    assert ids.tolist() == [table[t].tolist() for t in tokens.tolist()]
    for r in range(5):
        alone = router_topk_triton(
            step._replace(logits=logits[r : r + 1].clone(), token_ids=tokens[r : r + 1])
        )
        assert torch.equal(alone[0], weights[r : r + 1]) and torch.equal(alone[1], ids[r : r + 1])
    with pytest.raises(ValueError, match="hash_table"):
        router_topk_triton(step._replace(hash_table=table[:, :2]))
