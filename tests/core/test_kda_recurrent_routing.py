"""Kimi delta attention's CUDA row routing (``dgpp.nn.exact.recurrent``: verify and ``batch_invariant`` rows one
token at a time through the recurrent decode kernel, per-key-channel decay), run on the CPU under the Triton
interpreter: it equals the stock varlen layer, and a sequence's rows get the same bits alone as among others."""

from __future__ import annotations

import pytest
import torch

import dgpp.nn.kimi_delta_attention as kda_module
from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.nn.exact.recurrent import plan_rows
from dgpp.nn.kimi_delta_attention import KimiDeltaAttention
from dgpp.step.pools import CachePools
from dgpp.step.route import route_for

HIDDEN = 32


def _kda() -> KimiDeltaAttention:
    torch.manual_seed(0)
    kda = KimiDeltaAttention(
        "kda",
        hidden_size=HIDDEN,
        num_heads=2,
        head_dim=16,
        conv_kernel=4,
        lower_bound=-5.0,
        eps=1e-6,
        dtype=torch.float32,
    )
    with torch.no_grad():
        for p in kda.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        kda.A_log.copy_(torch.rand_like(kda.A_log) * 0.5)
    return kda


def _step(kda: KimiDeltaAttention, q_lens: list[int], ctx: list[int], seed: int):
    pools = CachePools({"kda": kda.cache_spec()}, 3 * len(q_lens) + 2, 4, len(q_lens) + 1)
    for t in pools.state["kda"].values():
        for slot in range(t.shape[0]):  # a slot's starting state does not depend on the slot count
            t[slot] = torch.randn(t.shape[1:], generator=torch.Generator().manual_seed(100 * seed + slot))
    works = [
        SeqWork(i, [3 * i, 3 * i + 1, 3 * i + 2], c, list(range(1, n + 1)))
        for i, (n, c) in enumerate(zip(q_lens, ctx, strict=True))
    ]
    return pools, build_batch(works, pools)


@pytest.mark.parametrize("verify", [False, True])
def test_kda_through_the_routed_plan_equals_the_stock_layer(monkeypatch, verify) -> None:
    q_lens, ctx = [3, 1, 2], [2, 5, 0]
    kda = _kda()
    pools, batch = _step(kda, q_lens, ctx, seed=1)
    hidden = torch.randn(sum(q_lens), HIDDEN)
    saved = {k: t.clone() for k, t in pools.state["kda"].items()}
    stock = kda(hidden, batch)
    stock_state = {k: t.clone() for k, t in pools.state["kda"].items()}
    for k, t in pools.state["kda"].items():
        t.copy_(saved[k])
    route = route_for(q_lens, "cpu", per_row=verify)
    monkeypatch.setattr(kda_module, "recurrent_plan", lambda b: plan_rows(b, route))
    routed = kda(hidden, batch)
    torch.testing.assert_close(routed, stock, rtol=1e-4, atol=1e-4)
    for k, t in pools.state["kda"].items():
        torch.testing.assert_close(t, stock_state[k], rtol=1e-4, atol=1e-4)


def test_kda_verify_rows_alone_equal_the_rows_among_others(monkeypatch) -> None:
    """Sequence 0's 3 verify rows, alone and beside 1..3 other sequences: identical output and state bits."""
    monkeypatch.setattr(
        kda_module, "recurrent_plan", lambda b: plan_rows(b, route_for(b.q_lens_cpu, "cpu", per_row=True))
    )
    kda = _kda()
    others = [(2, 4), (1, 7), (3, 0)]
    rows = torch.randn(3 + sum(n for n, _ in others), HIDDEN, generator=torch.Generator().manual_seed(3))
    results = []
    for n in range(len(others) + 1):
        q_lens, ctx = [3] + [q for q, _ in others[:n]], [6] + [c for _, c in others[:n]]
        pools, batch = _step(kda, q_lens, ctx, seed=2)  # the same starting state for sequence 0 each time
        out = kda(rows[: sum(q_lens)], batch)
        results.append((out[:3], {k: t[0].clone() for k, t in pools.state["kda"].items()}))
    alone_out, alone_state = results[0]
    for out, state in results[1:]:
        assert torch.equal(out, alone_out)
        assert all(torch.equal(state[k], alone_state[k]) for k in alone_state)
