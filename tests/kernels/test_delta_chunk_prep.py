"""The chunked gated delta rule's per-chunk UT transform in one launch (interpreter, fp32) against the torch
operands, and the chunked form through it and the walk against the token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dgpp.nn.gated_delta_rule as rule
from dgpp.kernels.delta_chunk_prep import chunk_prep_triton
from dgpp.kernels.delta_chunk_walk import chunk_walk_triton
from dgpp.kernels.gated_delta import gated_delta_ref


def _inputs(batch: int, length: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, hk, dk, generator=gen)
    k = torch.randn(batch, length, hk, dk, generator=gen)
    v = torch.randn(batch, length, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(batch, length, hv, generator=gen)) * 0.5  # log decay <= 0
    beta = torch.rand(batch, length, hv, generator=gen)
    state = torch.randn(batch, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(
    ("batch", "length", "hk", "hv", "dk", "dv", "chunk"),
    [(1, 64, 2, 2, 128, 128, 32), (2, 45, 1, 2, 32, 16, 16), (1, 70, 2, 4, 80, 48, 32)],
    ids=["release-width", "grouped-ragged", "odd-widths"],
)
def test_operands_match_the_torch_products(batch, length, hk, hv, dk, dv, chunk) -> None:
    q, k, v, g, beta, state = _inputs(batch, length, hk, hv, dk, dv, seed=length)
    got = chunk_prep_triton(q, k, v, g, beta, state, chunk)
    want = rule.chunk_operands(q, k, v, g, beta, state, chunk)
    for name, a, b in zip(got._fields, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # the solve counts: values_solved is not the right-hand side it was solved from
    rhs = (v * beta[..., None]).transpose(1, 2).reshape(batch * hv, -1, dv)[:, :chunk]
    assert (got.values_solved[:, 0] - rhs).abs().max() > 1e-2


def test_rows_past_the_length_read_as_zeros() -> None:
    """The last chunk's rows past the sequence: whatever lies in memory there must not reach the operands."""
    q, k, v, g, beta, state = _inputs(1, 40, 1, 2, 32, 16, seed=3)
    cut = 27  # views whose storage runs on past the cut
    got = chunk_prep_triton(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], state, 16)
    clean = [x[:, :cut].clone() for x in (q, k, v, g, beta)]
    want = rule.chunk_operands(*clean, state, 16)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.k_to_end[:, 1, cut - 16 :], torch.zeros_like(got.k_to_end[:, 1, cut - 16 :]))


def test_chunked_form_on_the_kernels_is_the_recurrence(monkeypatch) -> None:
    """``chunked_gated_delta_rule`` as CUDA runs it (prep and walk under the interpreter) against the token-by-token
    reference, over several chunks, a ragged tail and key heads shared by two value heads."""
    monkeypatch.setattr(rule, "use_triton", lambda x: True)
    monkeypatch.setattr(rule, "chunk_walk", chunk_walk_triton)
    total, hk, hv, dk, dv = 45, 1, 2, 32, 16
    q, k, v, g, beta, state = _inputs(1, total, hk, hv, dk, dv, seed=4)
    out, final = rule.chunked_gated_delta_rule(q, k, v, g, beta, state, 16)
    pool = state.clone()
    ref = gated_delta_ref(
        q[0],
        k[0],
        v[0],
        g[0],
        beta[0],
        pool,
        torch.tensor([0]),
        torch.tensor([0, total], dtype=torch.int32),
        torch.tensor([False]),
    )
    torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final[0], pool[0], rtol=1e-4, atol=1e-4)


def test_shape_errors_name_the_layout() -> None:
    q, k, v, g, beta, state = _inputs(1, 20, 1, 2, 16, 16, seed=5)
    with pytest.raises(ValueError, match="chunk_prep takes"):
        chunk_prep_triton(q, k, v, g[..., None].expand(-1, -1, -1, 16), beta, state, 16)
    with pytest.raises(ValueError, match="power of two"):
        chunk_prep_triton(q, k, v, g, beta, state, 24)
