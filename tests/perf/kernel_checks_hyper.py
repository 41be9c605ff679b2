"""Hyper-connection kernels on the GPU at the releases' sizes (hidden 4096, 4 streams, 20 Sinkhorn iterations,
bf16 streams): collapse, expand, the head collapse and the single-pass collapse against the torch chain they replace (max differences,
bit-equal or not), a row alone against the batch (bit for bit), and both timed (CUDA events)."""

from __future__ import annotations

import torch
from check_glm5_cuda import _timed

from dgpp.kernels.hyper_connections import hc_collapse, hc_expand
from dgpp.nn.hyper_connections import HyperConnection, HyperHead
from dgpp.policy import overriding

HIDDEN, STREAMS, ITERS = 4096, 4, 20


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _layer(gen: torch.Generator) -> HyperConnection:
    layer = HyperConnection(HIDDEN, STREAMS, sinkhorn_iters=ITERS).cuda()
    n = STREAMS
    layer.fn.copy_(torch.randn((2 + n) * n, n * HIDDEN, generator=gen, device="cuda") * 0.02)
    layer.base.copy_(torch.randn((2 + n) * n, generator=gen, device="cuda"))
    layer.scale.copy_(torch.rand(3, generator=gen, device="cuda") + 0.5)
    return layer


def hyper_connection_checks(failures: list[str]) -> list[str]:
    out: list[str] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = _layer(gen)
    head = HyperHead(HIDDEN, STREAMS).cuda()
    head.hc_fn.copy_(torch.randn(STREAMS, STREAMS * HIDDEN, generator=gen, device="cuda") * 0.02)
    head.hc_base.copy_(torch.randn(STREAMS, generator=gen, device="cuda"))
    head.hc_scale.copy_(torch.rand(1, generator=gen, device="cuda") + 0.5)
    for rows in (1, 8, 64):
        streams = torch.randn(rows, STREAMS, HIDDEN, generator=gen, device="cuda").bfloat16()
        sub_out = torch.randn(rows, HIDDEN, generator=gen, device="cuda").bfloat16()
        mixes = layer._mixes(streams, layer.fn)

        def fused(m=mixes, s=streams):
            return hc_collapse(m, layer.base, layer.scale, s, sinkhorn_iters=ITERS, eps=layer.eps)

        x, post, comb = fused()
        want_x, want_post, want_comb = layer.collapse_of(mixes, streams)
        new = hc_expand(streams, sub_out, post, comb)
        with overriding(triton_kernels=False):
            want_new = layer.expand(streams, sub_out, post, comb)
            want_head = head(streams)
            t_chain = _timed(layer.collapse_of, mixes, streams)
            t_chain_expand = _timed(layer.expand, streams, sub_out, post, comb)
            given_x = layer.collapse_given(streams, post)[0]  # single pass (V4.1): any [T, N] weights
        got_head = head(streams)
        got_given_x = layer.collapse_given(streams, post)[0]
        t_fused, t_expand = _timed(fused), _timed(hc_expand, streams, sub_out, post, comb)
        x1, post1, comb1 = hc_collapse(
            mixes[-1:], layer.base, layer.scale, streams[-1:], sinkhorn_iters=ITERS, eps=layer.eps
        )
        alone = (
            torch.equal(x1[0], x[-1]) and torch.equal(comb1[0], comb[-1]) and torch.equal(post1[0], post[-1])
        )
        coeff = max(_maxdiff(post, want_post), _maxdiff(comb, want_comb))
        expand_equal = torch.equal(new, want_new)
        out.append(
            f"hc collapse rows {rows}: post/comb max diff {coeff:.1e}, x bf16 max diff "
            f"{_maxdiff(x, want_x):.1e} ({'bit-equal' if torch.equal(x, want_x) else 'not bit-equal'}), "
            f"row alone == batched: {alone}; {t_fused * 1e6:.1f} us vs torch chain {t_chain * 1e6:.1f} us"
        )
        out.append(
            f"hc expand rows {rows}: {'bit-equal' if expand_equal else f'max diff {_maxdiff(new, want_new):.1e}'} "
            f"to the torch chain; {t_expand * 1e6:.1f} us vs {t_chain_expand * 1e6:.1f} us; head collapse max "
            f"diff {_maxdiff(got_head, want_head):.1e}, single-pass x max diff {_maxdiff(got_given_x, given_x):.1e}"
        )
        pairs = ((new, want_new), (x, want_x), (got_head, want_head), (got_given_x, given_x))
        bf16_close = all(_maxdiff(a, b) <= 2e-2 * float(b.float().abs().max()) for a, b in pairs)  # bf16 ulps
        if not (coeff < 1e-5 and alone and bf16_close):
            failures.append(f"hyper-connection kernels rows {rows}: {out[-2]} / {out[-1]}")
    return out
