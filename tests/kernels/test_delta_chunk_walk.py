"""The chunked gated delta rule's chunk-to-chunk walk (interpreter, fp32) against its torch products, and the
chunked form through it against the token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dgpp.kernels.delta_chunk_walk as walk
from dgpp.kernels.gated_delta import gated_delta_ref


def _operands(heads: int, chunks: int, chunk: int, dk: int, dv: int, seed: int) -> walk.ChunkWalkInputs:
    g = torch.Generator().manual_seed(seed)
    return walk.ChunkWalkInputs(
        torch.randn(heads, chunks, chunk, dv, generator=g),
        torch.randn(heads, chunks, chunk, dk, generator=g) * dk**-0.5,
        torch.randn(heads, chunks, chunk, dk, generator=g) * dk**-0.5,
        torch.randn(heads, chunks, chunk, chunk, generator=g).tril() * chunk**-0.5,
        torch.randn(heads, chunks, chunk, dk, generator=g) * dk**-0.5,
        torch.rand(heads, chunks, generator=g) * 0.5 + 0.5,
        torch.randn(heads, dk, dv, generator=g),
    )


@pytest.mark.parametrize(("dk", "dv"), [(128, 64), (80, 48)], ids=["release", "ragged"])
def test_walk_matches_the_torch_products(dk: int, dv: int) -> None:
    ops = _operands(2, 3, 16, dk, dv, seed=dk)
    out, state = walk.chunk_walk_triton(ops)
    ref_out, ref_state = walk.chunk_walk_ref(ops)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)
    # the hand-off counts: chunk 2 read the state chunks 0 and 1 left, so a different start moves it
    moved = walk.chunk_walk_triton(ops._replace(state=ops.state + 1.0))[0]
    assert (moved[:, 2] - out[:, 2]).abs().max() > 1e-2
    assert torch.equal(
        ops.state, _operands(2, 3, 16, dk, dv, seed=dk).state
    )  # the input state is not written


def test_chunked_form_through_the_walk_is_the_recurrence(monkeypatch) -> None:
    """``chunked_gated_delta_rule`` with the walk as CUDA runs it (here under the interpreter) against the
    token-by-token reference, over several chunks and a ragged tail."""
    import dgpp.nn.gated_delta_rule as rule

    monkeypatch.setattr(rule, "chunk_walk", walk.chunk_walk_triton)
    gen = torch.Generator().manual_seed(4)
    total, hk, hv, dk, dv = 45, 1, 2, 32, 16
    q, k = torch.randn(total, hk, dk, generator=gen), torch.randn(total, hk, dk, generator=gen)
    v = torch.randn(total, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(total, hv, generator=gen)) * 0.5
    beta = torch.rand(total, hv, generator=gen)
    state = torch.randn(1, hv, dk, dv, generator=gen)
    out, final = rule.chunked_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state, 16)
    pool = state.clone()
    ref = gated_delta_ref(
        q,
        k,
        v,
        g,
        beta,
        pool,
        torch.tensor([0]),
        torch.tensor([0, total], dtype=torch.int32),
        torch.tensor([False]),
    )
    torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final[0], pool[0], rtol=1e-4, atol=1e-4)
