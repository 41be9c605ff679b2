"""Gated DeltaNet kernels (interpreter) against the token-by-token torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.kernels.gated_delta import gated_delta_ref, gdn_chunked_prefill_triton, gdn_decode_step_triton


def _inputs(total: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, hk, dk, generator=gen)
    k = torch.randn(total, hk, dk, generator=gen)
    v = torch.randn(total, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(total, hv, generator=gen)) * 0.5  # log decay <= 0
    beta = torch.rand(total, hv, generator=gen)
    return q, k, v, g, beta


def test_decode_step_matches_reference_and_updates_pool() -> None:
    q, k, v, g, beta = _inputs(4, 2, 4, 16, 48, seed=0)
    pool = torch.randn(6, 4, 16, 48, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([3, -1, 0, 5])  # row 1 is graph padding
    fresh = torch.tensor([False, False, True, False])
    starts = torch.arange(5, dtype=torch.int32)
    pool_ref = pool.clone()
    ref = gated_delta_ref(q, k, v, g, beta, pool_ref, slots, starts, fresh)
    out = gdn_decode_step_triton(q, k, v, g, beta, pool, slots, fresh)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_chunked_prefill_matches_reference_across_chunks() -> None:
    lens = [37, 1, 16, 5]
    q, k, v, g, beta = _inputs(sum(lens), 1, 2, 16, 24, seed=2)
    # q/k as strided views of one packed projection, as the GDN layer produces them
    packed = torch.cat([q.flatten(1), k.flatten(1), torch.zeros(sum(lens), 3)], dim=1)
    q, k = packed[:, :16].view(-1, 1, 16), packed[:, 16:32].view(-1, 1, 16)
    pool = torch.randn(5, 2, 16, 24, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([4, 1, 2, 0])
    fresh = torch.tensor([True, False, False, True])
    starts = torch.tensor([0, 37, 38, 54, 59], dtype=torch.int32)
    pool_ref = pool.clone()
    ref = gated_delta_ref(q, k, v, g, beta, pool_ref, slots, starts, fresh)
    out = gdn_chunked_prefill_triton(q, k, v, g, beta, pool, slots, starts, fresh, chunk_size=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(pool[3], pool_ref[3])  # untouched slot


def test_prefill_then_decode_continues_the_state() -> None:
    q, k, v, g, beta = _inputs(21, 2, 2, 16, 16, seed=4)
    pool = torch.zeros(1, 2, 16, 16)
    slots = torch.tensor([0])
    out_pf = gdn_chunked_prefill_triton(
        q[:20],
        k[:20],
        v[:20],
        g[:20],
        beta[:20],
        pool,
        slots,
        torch.tensor([0, 20], dtype=torch.int32),
        torch.tensor([True]),
        chunk_size=16,
    )
    out_dec = gdn_decode_step_triton(
        q[20:], k[20:], v[20:], g[20:], beta[20:], pool, slots, torch.tensor([False])
    )
    whole = gated_delta_ref(
        q,
        k,
        v,
        g,
        beta,
        torch.zeros(1, 2, 16, 16),
        slots,
        torch.tensor([0, 21], dtype=torch.int32),
        torch.tensor([True]),
    )
    torch.testing.assert_close(torch.cat([out_pf, out_dec]), whole, rtol=1e-4, atol=1e-4)


def test_reference_agrees_with_layer_torch_path() -> None:
    # the reference is independent of dgpp.nn's chunked form: check they compute the same function
    from dgpp.nn.gated_deltanet import chunked_gated_delta_rule

    q, k, v, g, beta = _inputs(40, 1, 2, 16, 16, seed=5)
    state = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(6))
    out_nn, state_nn = chunked_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state, 16)
    pool = state.clone()
    ref = gated_delta_ref(
        q,
        k,
        v,
        g,
        beta,
        pool,
        torch.tensor([0]),
        torch.tensor([0, 40], dtype=torch.int32),
        torch.tensor([False]),
    )
    torch.testing.assert_close(ref, out_nn[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[0], state_nn[0], rtol=1e-4, atol=1e-4)


def test_per_channel_decay_decode_matches_reference() -> None:
    """Kimi delta attention's decay (one factor per head and key channel) on the decode kernel."""
    q, k, v, _, beta = _inputs(4, 2, 2, 16, 24, seed=6)
    g = -F.softplus(torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(7)))
    pool = torch.randn(5, 2, 16, 24, generator=torch.Generator().manual_seed(8))
    slots = torch.tensor([2, 0, -1, 4])
    fresh = torch.tensor([False, True, False, False])
    starts = torch.arange(5, dtype=torch.int32)
    pool_ref = pool.clone()
    ref = gated_delta_ref(q, k, v, g, beta, pool_ref, slots, starts, fresh)
    out = gdn_decode_step_triton(q, k, v, g, beta, pool, slots, fresh)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-4, atol=1e-5)
    # one shared factor per head is a different answer: the per-channel factors reach the state
    per_head = pool_ref.clone()
    gated_delta_ref(q, k, v, g.mean(-1), beta, per_head, slots, starts, fresh)
    assert not torch.allclose(per_head, pool_ref, rtol=1e-3, atol=1e-3)


def test_per_channel_decode_row_alone_equals_row_among_others() -> None:
    """A row's output and state bits do not depend on which rows share the launch."""
    total = 5
    q, k, v, _, beta = _inputs(total, 1, 2, 16, 16, seed=9)
    g = -F.softplus(torch.randn(total, 2, 16, generator=torch.Generator().manual_seed(10)))
    base = torch.randn(total, 2, 16, 16, generator=torch.Generator().manual_seed(11))
    fresh = torch.zeros(total, dtype=torch.bool)
    together = base.clone()
    out_all = gdn_decode_step_triton(q, k, v, g, beta, together, torch.arange(total), fresh)
    for n in range(1, total + 1):
        pool = base.clone()
        out = gdn_decode_step_triton(q[:n], k[:n], v[:n], g[:n], beta[:n], pool, torch.arange(n), fresh[:n])
        assert torch.equal(out, out_all[:n]) and torch.equal(pool[:n], together[:n])
    alone = base.clone()
    row = slice(3, 4)
    out = gdn_decode_step_triton(
        q[row], k[row], v[row], g[row], beta[row], alone, torch.tensor([3]), fresh[row]
    )
    assert torch.equal(out[0], out_all[3]) and torch.equal(alone[3], together[3])


def test_chunked_kernel_refuses_a_per_channel_decay() -> None:
    q, k, v, _, beta = _inputs(3, 1, 1, 16, 16, seed=12)
    g = torch.zeros(3, 1, 16)
    with pytest.raises(ValueError, match="per head"):
        gdn_chunked_prefill_triton(
            q,
            k,
            v,
            g,
            beta,
            torch.zeros(1, 1, 16, 16),
            torch.tensor([0]),
            torch.tensor([0, 3]),
            torch.tensor([True]),
        )
