"""Sink / sliding-window attention and the window ring: Triton (interpreter, fp32) against the torch reference, with
values as wide as the keys and narrower ones on a head dim that is not a power of two (MiMo: q/k 192, v 128)."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.ring_write import RingWriteInputs, ring_write_ref, ring_write_triton
from dgpp.kernels.window_attention import window_attention_ref, window_attention_triton

DIMS = [(16, 16), (48, 32)]  # (q/k head dim, v head dim)


def _step(ctx: list[int], q_lens: list[int], hq: int, hk: int, dim: int, seed: int, v_dim: int | None = None):
    g = torch.Generator().manual_seed(seed)
    rows = sum(q_lens)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(rows, hq, dim, generator=g)
    k = torch.randn(rows, hk, dim, generator=g)
    v = torch.randn(rows, hk, v_dim or dim, generator=g)
    return (
        q,
        k,
        v,
        starts,
        torch.tensor(ctx, dtype=torch.int32),
        torch.tensor([c + n for c, n in zip(ctx, q_lens, strict=True)], dtype=torch.int32),
    )


@pytest.mark.parametrize(("dim", "v_dim"), DIMS)
@pytest.mark.parametrize(("window", "sinks"), [(7, True), (7, False), (40, True)])
def test_ring_attention_matches_reference(window: int, sinks: bool, dim: int, v_dim: int) -> None:
    """Decode rows, a chunk starting mid-sequence past the window, a first chunk, a padding row (slot -1)."""
    hq, hk = 4, 2
    q, k, v, starts, ctx, lens = _step([30, 3, 0, 0], [1, 9, 12, 1], hq, hk, dim, seed=window, v_dim=v_dim)
    g = torch.Generator().manual_seed(1)
    k_ring = torch.randn(5, window - 1, hk, dim, generator=g)
    v_ring = torch.randn(5, window - 1, hk, v_dim, generator=g)
    slots = torch.tensor([3, 0, 2, -1])
    lens[3] = 0
    sink = torch.randn(hq, generator=g) if sinks else None
    args = (q, k, v, k_ring, v_ring, slots, starts, ctx, lens, sink, 0.3, window, False)
    out = window_attention_triton(*args)
    assert out.shape == (q.shape[0], hq, v_dim)
    torch.testing.assert_close(out, window_attention_ref(*args), rtol=1e-5, atol=1e-5)
    assert float(out[-1].abs().max()) == 0.0


@pytest.mark.parametrize(("dim", "v_dim"), DIMS)
def test_paged_sink_attention_matches_reference(dim: int, v_dim: int) -> None:
    hq, hk, bs = 6, 2, 4
    q, k, v, starts, ctx, lens = _step([70, 0], [1, 13], hq, hk, dim, seed=3, v_dim=v_dim)
    g = torch.Generator().manual_seed(4)
    k_cache = torch.randn(40, bs, hk, dim, generator=g)
    v_cache = torch.randn(40, bs, hk, v_dim, generator=g)
    tables = torch.randperm(40, generator=g)[:36].view(2, 18).int()
    sink = torch.randn(hq, generator=g)
    for window in (0, 9):
        args = (q, None, None, k_cache, v_cache, tables, starts, ctx, lens, sink, 0.25, window, True)
        torch.testing.assert_close(
            window_attention_triton(*args), window_attention_ref(*args), rtol=1e-5, atol=1e-5
        )


def test_wide_heads_split_the_query_heads_over_programs() -> None:
    """DeepSeek-V4's shape in small: one 512-wide K == V head under 40 query heads (3 head groups of 16, the last
    partial) walked in 16-key tiles; equals the reference on ring and fresh keys alike."""
    hq, hk, dim, window = 40, 1, 512, 20
    q, k, _, starts, ctx, lens = _step([25, 0], [1, 6], hq, hk, dim, seed=7)
    g = torch.Generator().manual_seed(8)
    ring = torch.randn(2, window - 1, hk, dim, generator=g)
    sink = torch.randn(hq, generator=g)
    args = (q, k, k, ring, ring, torch.tensor([1, 0]), starts, ctx, lens, sink, dim**-0.5, window, False)
    torch.testing.assert_close(
        window_attention_triton(*args), window_attention_ref(*args), rtol=1e-5, atol=1e-5
    )


def test_sink_is_an_extra_softmax_logit() -> None:
    """A huge sink takes all the probability (output ~0); a very negative one leaves plain softmax attention."""
    q, k, v, starts, ctx, lens = _step([0], [5], 2, 1, 8, seed=5)
    ring = torch.zeros(1, 3, 1, 8)
    args = (q, k, v, ring, ring, torch.tensor([0]), starts, ctx, lens)
    big = window_attention_triton(*args, torch.full((2,), 80.0), 0.5, 4, False)
    assert float(big.abs().max()) < 1e-20
    none = window_attention_triton(*args, None, 0.5, 4, False)
    tiny = window_attention_triton(*args, torch.full((2,), -80.0), 0.5, 4, False)
    torch.testing.assert_close(tiny, none)


@pytest.mark.parametrize("v_dim", [8, 6])
def test_ring_write_keeps_the_last_positions(v_dim: int) -> None:
    hk, dim, cap = 2, 8, 5
    _, k, v, starts, ctx, lens = _step([2, 9, 0], [11, 1, 3], 2, hk, dim, seed=6, v_dim=v_dim)
    slots = torch.tensor([1, 0, -1])
    rings = [torch.full((3, cap, hk, d), -7.0) for d in (dim, v_dim, dim, v_dim)]
    ring_write_ref(RingWriteInputs(k, v, rings[0], rings[1], slots, starts, ctx, lens))
    ring_write_triton(RingWriteInputs(k, v, rings[2], rings[3], slots, starts, ctx, lens))
    torch.testing.assert_close(rings[2], rings[0])
    torch.testing.assert_close(rings[3], rings[1])
    # sequence 0 ends at position 12: positions 8..12 at indices 3,4,0,1,2 = its rows 6..10
    torch.testing.assert_close(rings[0][1, torch.tensor([3, 4, 0, 1, 2])], k[6:11])
    torch.testing.assert_close(rings[0][0, 9 % cap], k[11])
    assert bool((rings[0][2] == -7.0).all())  # slot 2 untouched by the padding row
