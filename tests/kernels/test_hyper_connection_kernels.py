"""Hyper-connection kernels (``dgpp.kernels.hyper_connections``, Triton's interpreter) against the torch chain
of ``dgpp.nn.hyper_connections``: collapse (coefficients, Sinkhorn, weighted sum), expand and the head."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.hyper_connections import hc_collapse, hc_collapse_given, hc_expand, hc_head
from dgpp.nn.hyper_connections import HyperConnection, HyperHead, sinkhorn

H, T = 48, 5


def _layer(n: int, iters: int, eps: float, seed: int) -> HyperConnection:
    gen = torch.Generator().manual_seed(seed)
    layer = HyperConnection(H, n, sinkhorn_iters=iters, eps=eps, norm_eps=1e-6)
    # spread logits: comb far from uniform, so Sinkhorn takes many iterations to settle
    layer.fn.data.copy_(torch.randn((2 + n) * n, n * H, generator=gen) * 0.5)
    layer.base.data.copy_(torch.randn((2 + n) * n, generator=gen) * 2)
    layer.scale.data.copy_(torch.rand(3, generator=gen) + 0.5)
    return layer


def _streams(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, n, H, generator=gen).to(dtype)


def _kernel_collapse(layer: HyperConnection, streams: torch.Tensor):
    mixes = layer._mixes(streams, layer.fn)
    return hc_collapse(
        mixes, layer.base, layer.scale, streams, sinkhorn_iters=layer.sinkhorn_iters, eps=layer.eps
    )


@pytest.mark.parametrize(("n", "iters", "eps"), [(4, 20, 1e-6), (4, 2, 1e-6), (3, 20, 1e-3), (4, 1, 1e-3)])
def test_collapse_matches_the_torch_chain(n: int, iters: int, eps: float) -> None:
    layer = _layer(n, iters, eps, seed=n + iters)
    streams = _streams(n, seed=iters)
    with torch.no_grad():
        x, post, comb = _kernel_collapse(layer, streams)
        want_x, want_post, want_comb = layer.collapse(streams)  # CPU tensors: the torch chain
    torch.testing.assert_close(post, want_post, rtol=0, atol=1e-6)
    torch.testing.assert_close(comb, want_comb, rtol=0, atol=1e-6)
    torch.testing.assert_close(x, want_x, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(comb, comb.transpose(1, 2), atol=1e-3)  # comb is not symmetric here


def test_collapse_runs_every_sinkhorn_iteration_and_keeps_eps() -> None:
    layer = _layer(4, 20, 1e-3, seed=11)
    streams = _streams(4, seed=12)
    with torch.no_grad():
        _, _, comb = _kernel_collapse(layer, streams)
        pre, _, _ = layer.coefficients(streams)
        mixes = layer._mixes(streams, layer.fn)
    logits = (mixes[:, 8:] * layer.scale[2] + layer.base[8:]).reshape(T, 4, 4)
    soft = torch.softmax(logits, dim=-1)
    one_short = sinkhorn(soft + 1e-3, 19, 1e-3)
    no_eps = sinkhorn(soft, 20, 0.0)
    want = sinkhorn(soft + 1e-3, 20, 1e-3)
    torch.testing.assert_close(comb, want, rtol=0, atol=1e-6)
    # the cases above are told apart at this tolerance: one iteration less, or eps dropped, would fail
    assert (one_short - want).abs().max() > 1e-5
    assert (no_eps - want).abs().max() > 1e-5
    assert pre.min() > 1e-3  # pre's eps


@pytest.mark.parametrize("n", [4, 2])
def test_expand_matches_the_torch_chain(n: int) -> None:
    layer = _layer(n, 20, 1e-6, seed=3)
    streams = _streams(n, seed=4)
    out = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, post, comb = layer.coefficients(streams)
        got = hc_expand(streams, out, post, comb)
        want = layer.expand(streams, out, post, comb)
        untransposed = layer.expand(streams, out, post, comb.transpose(1, 2))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (untransposed - want).abs().max() > 1e-2  # reading comb[k, j] instead would fail


def test_bf16_streams_round_as_the_torch_chain() -> None:
    # the interpreter rounds fp32 -> bf16 its own way (a GPU rounds to nearest): a few bf16 ulps here
    layer = _layer(4, 20, 1e-6, seed=7)
    streams = _streams(4, seed=8, dtype=torch.bfloat16)
    out = torch.randn(T, H, generator=torch.Generator().manual_seed(9)).bfloat16()
    with torch.no_grad():
        x, post, comb = _kernel_collapse(layer, streams)
        want_x, want_post, want_comb = layer.collapse(streams)
        new = hc_expand(streams, out, post, comb)
        want_new = layer.expand(streams, out, want_post, want_comb)
    assert x.dtype == new.dtype == torch.bfloat16
    torch.testing.assert_close(comb, want_comb, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.float(), want_x.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(new.float(), want_new.float(), rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("n", [4, 3])
def test_head_matches_the_torch_chain(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    head = HyperHead(H, n, eps=1e-3, norm_eps=1e-6)
    head.hc_fn.data.copy_(torch.randn(n, n * H, generator=gen) * 0.5)
    head.hc_base.data.copy_(torch.randn(n, generator=gen))
    head.hc_scale.data.copy_(torch.rand(1, generator=gen) + 0.5)
    streams = _streams(n, seed=n + 1)
    with torch.no_grad():
        got = hc_head(head._mixes(streams, head.hc_fn), head.hc_base, head.hc_scale, streams, eps=head.eps)
        want = head(streams)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rows_are_independent_bit_for_bit() -> None:
    layer = _layer(4, 20, 1e-6, seed=13)
    streams = _streams(4, seed=14)
    out = torch.randn(T, H, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        x, post, comb = _kernel_collapse(layer, streams)
        new = hc_expand(streams, out, post, comb)
        for t in (0, T - 1):
            x1, post1, comb1 = _kernel_collapse(layer, streams[t : t + 1])
            assert (
                torch.equal(x1[0], x[t]) and torch.equal(post1[0], post[t]) and torch.equal(comb1[0], comb[t])
            )
            assert torch.equal(hc_expand(streams[t : t + 1], out[t : t + 1], post1, comb1)[0], new[t])


def test_collapse_given_weights_the_streams_by_the_given_pre() -> None:
    layer = _layer(4, 20, 1e-6, seed=17)
    streams = _streams(4, seed=18)
    given = torch.rand(T, 4, generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        mixes = layer._mixes(streams, layer.fn)
        x, pre, post, comb = hc_collapse_given(
            mixes, layer.base, layer.scale, streams, given.t().contiguous().t(), sinkhorn_iters=20, eps=1e-6
        )
        want_x, want_pre, want_post, want_comb = layer.collapse_given(streams, given)  # the torch chain
        own_x, _, _ = layer.collapse(streams)
    torch.testing.assert_close(x, want_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pre, want_pre, rtol=0, atol=1e-6)
    torch.testing.assert_close(post, want_post, rtol=0, atol=1e-6)
    torch.testing.assert_close(comb, want_comb, rtol=0, atol=1e-6)
    assert (x - own_x).abs().max() > 1e-2  # weighted by the given pre, not its own


def test_a_hidden_axis_of_several_tiles_splits_over_programs_without_changing_a_bit() -> None:
    # hidden 1000: four 256-wide tiles, the last ragged. One row spreads them over four programs a stream;
    # 70 rows walk two tiles (collapse) or the whole row (expand) per program: the same bits either way.
    hidden, rows, n = 1000, 70, 4
    gen = torch.Generator().manual_seed(21)
    layer = HyperConnection(hidden, n, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    layer.fn.data.copy_(torch.randn((2 + n) * n, n * hidden, generator=gen) * 0.1)
    layer.base.data.copy_(torch.randn((2 + n) * n, generator=gen))
    layer.scale.data.copy_(torch.rand(3, generator=gen) + 0.5)
    head = HyperHead(hidden, n, eps=1e-6, norm_eps=1e-6)
    head.hc_fn.data.copy_(torch.randn(n, n * hidden, generator=gen) * 0.1)
    head.hc_base.data.copy_(torch.randn(n, generator=gen))
    head.hc_scale.data.copy_(torch.rand(1, generator=gen) + 0.5)
    streams = torch.randn(rows, n, hidden, generator=gen)
    out = torch.randn(rows, hidden, generator=gen)
    given = torch.rand(rows, n, generator=gen)
    with torch.no_grad():
        mixes, head_mixes = layer._mixes(streams, layer.fn), head._mixes(streams, head.hc_fn)

        def passes(r: slice):
            coeffs = (mixes[r], layer.base, layer.scale, streams[r])
            x, post, comb = hc_collapse(*coeffs, sinkhorn_iters=20, eps=1e-6)
            given_form = hc_collapse_given(*coeffs, given[r], sinkhorn_iters=20, eps=1e-6)
            head_x = hc_head(head_mixes[r], head.hc_base, head.hc_scale, streams[r], eps=1e-6)
            return (x, post, comb, hc_expand(streams[r], out[r], post, comb), *given_form, head_x)

        batched = passes(slice(0, rows))
        want_x, want_post, want_comb = layer.collapse_of(mixes, streams)  # the torch chain
        want_pre = layer.coefficients_of(mixes)[0]
        torch.testing.assert_close(batched[0], want_x, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batched[1], want_post, rtol=0, atol=1e-6)
        torch.testing.assert_close(batched[2], want_comb, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            batched[3], layer.expand(streams, out, want_post, want_comb), rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(batched[4], layer.collapse_given(streams, given)[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batched[5], want_pre, rtol=0, atol=1e-6)
        torch.testing.assert_close(batched[8], head(streams), rtol=1e-6, atol=1e-6)
        for t in (0, 33, rows - 1):
            solo = passes(slice(t, t + 1))
            for got, whole in zip(solo, batched, strict=True):
                assert torch.equal(got[0], whole[t])


@pytest.mark.parametrize("head", [False, True], ids=["sublayer", "head"])
def test_settled_projection_is_padded_once_and_computes_the_same_mixes(head: bool) -> None:
    """``settle_weights`` pads the projection's 24 (head: 4) rows to 32 (16) once: the parameter keeps its shape
    and values as a view of the padded rows, and the CUDA branch's projection then launches no pad, with the
    mixes of the per-call pad (the same fixed-order product, the zero rows cut off)."""
    from collections import Counter

    from dgpp.bench.launches import cuda_path
    from dgpp.step.route import in_flight, route_for

    n = 4
    gen = torch.Generator().manual_seed(8)
    layer: HyperConnection | HyperHead = HyperHead(64, n) if head else HyperConnection(64, n)
    weight = layer.hc_fn if isinstance(layer, HyperHead) else layer.fn
    weight.data.copy_(torch.randn(weight.shape, generator=gen))
    streams = torch.randn(3, n, 64, generator=gen).bfloat16()
    with cuda_path() as recorder, in_flight(route_for([1, 1, 1], streams.device)):
        recorder.target = before = Counter()
        unsettled = layer._mixes(streams, weight)
        recorder.target = None
        values = weight.detach().clone()
        layer.settle_weights()
        recorder.target = after = Counter()
        settled = layer._mixes(streams, weight)
    assert layer.projection_rows is not None and layer.projection_rows.shape[0] == (16 if head else 32)
    assert torch.equal(weight, values) and weight.data_ptr() == layer.projection_rows.data_ptr()
    assert not layer.projection_rows[weight.shape[0] :].any()
    assert before["aten.constant_pad_nd"] == 1 and after == Counter({"rms_norm": 1, "multi_linear": 1})
    assert torch.equal(settled, unsettled)
