"""The multi-stream residual's norm and mix kernels (interpreter, fp32) against their torch references, and against
the gated residual module they replace on the CUDA path."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.hyper_streams import (
    StreamMixInputs,
    StreamNormInputs,
    stream_mix_ref,
    stream_mix_triton,
    stream_norm_ref,
    stream_norm_triton,
)

STREAMS, HIDDEN, RANK = 4, 80, 16


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _norm_inputs(tokens: int, seed: int) -> StreamNormInputs:
    g = torch.Generator().manual_seed(seed)
    return StreamNormInputs(
        torch.randn(tokens, STREAMS * HIDDEN, generator=g),
        torch.randn(STREAMS * HIDDEN, generator=g) * 0.5,
        1e-6,
        STREAMS,
        torch.randn(tokens, HIDDEN, generator=g),
        torch.randn(tokens, 2 * STREAMS, generator=g)[:, 1 : 1 + STREAMS],  # a column slice, as from one GEMV
    )


@pytest.mark.parametrize("tokens", [1, 3])
def test_stream_norm_with_injection_matches_reference(tokens: int) -> None:
    step = _norm_inputs(tokens, tokens)
    normed, hyper = stream_norm_triton(step)
    ref_normed, ref_hyper = stream_norm_ref(step)
    _close(hyper, ref_hyper)
    _close(normed, ref_normed)
    # every stream's injection weight counts: a changed logit moves that stream only
    moved = step._replace(logits=step.logits.clone().index_fill_(1, torch.tensor([2]), 3.0))
    moved_hyper = stream_norm_triton(moved)[1].unflatten(-1, (STREAMS, HIDDEN))
    diff = (moved_hyper - hyper.unflatten(-1, (STREAMS, HIDDEN))).abs().amax(dim=(0, 2))
    assert diff[2] > 1e-3 and torch.all(diff[[0, 1, 3]] == 0)


def test_stream_norm_without_injection_is_the_grouped_norm() -> None:
    step = _norm_inputs(2, 7)._replace(block_out=None, logits=None)
    normed, hyper = stream_norm_triton(step)
    assert hyper is step.hyper
    _close(normed, stream_norm_ref(step)[0])
    # per-stream weights: the norm of stream 1 uses weight row 1
    flipped = step._replace(weight=step.weight.clone().index_fill_(0, torch.arange(HIDDEN, 2 * HIDDEN), 0.0))
    changed = (
        (stream_norm_triton(flipped)[0] - normed).unflatten(-1, (STREAMS, HIDDEN)).abs().amax(dim=(0, 2))
    )
    assert changed[1] > 1e-3 and torch.all(changed[[0, 2, 3]] == 0)


@pytest.mark.parametrize("tokens", [1, 4])
def test_stream_mix_matches_reference(tokens: int) -> None:
    g = torch.Generator().manual_seed(10 + tokens)
    normed = torch.randn(tokens, STREAMS * HIDDEN, generator=g)
    low = torch.randn(tokens, RANK + STREAMS, generator=g)[:, :RANK]  # the down part of a fused projection
    up = torch.randn(STREAMS * HIDDEN, RANK, generator=g) * 0.3
    step = StreamMixInputs(normed, low, up, STREAMS)
    out = stream_mix_triton(step)
    _close(out, stream_mix_ref(step))
    # a stream's mix weight counts: zeroing stream 3's up rows (weight σ(0) = 0.5) changes the mean
    cut = up.clone()
    cut[3 * HIDDEN :] = 0
    assert (stream_mix_triton(step._replace(up_weight=cut)) - out).abs().max() > 1e-3


def test_stream_mix_with_the_release_rank_matches_reference() -> None:
    """The release's bottleneck (r = 320, padded to 512 in one product) over a ragged last column tile and more
    tokens than one 16-token tile: every token gets the reference's mix, and a token alone the bits it gets among
    40."""
    hidden, rank, tokens = 84, 320, 40
    g = torch.Generator().manual_seed(31)
    normed = torch.randn(tokens, STREAMS * hidden, generator=g)
    low = torch.randn(tokens, rank, generator=g)
    up = torch.randn(STREAMS * hidden, rank, generator=g) * rank**-0.5
    step = StreamMixInputs(normed, low, up, STREAMS)
    out = stream_mix_triton(step)
    _close(out, stream_mix_ref(step))
    for row in (2, 37):
        alone = stream_mix_triton(StreamMixInputs(normed[row : row + 1], low[row : row + 1], up, STREAMS))
        assert torch.equal(alone[0], out[row])
    # the whole bottleneck counts: a column past the first 256 moves the mix
    moved = low.clone()
    moved[:, 300] += 4.0
    assert (stream_mix_triton(step._replace(low=moved)) - out).abs().max() > 1e-3


def test_kernels_match_the_gated_residual_module() -> None:
    from dgpp_qwen.layers.gated_residual import GatedResidual

    g = torch.Generator().manual_seed(3)
    gr = GatedResidual(HIDDEN, STREAMS, RANK, 1e-6, dtype=torch.float32)
    for p in gr.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hyper = torch.randn(3, STREAMS * HIDDEN, generator=g)
    block_out = torch.randn(3, HIDDEN, generator=g)
    x, logits = gr.mix(hyper)
    normed, _ = stream_norm_triton(StreamNormInputs(hyper, gr.hc_norm.weight, 1e-6, STREAMS))
    low = gr.input_mix_weight_down(normed)
    _close(stream_mix_triton(StreamMixInputs(normed, low, gr.input_mix_weight_up.weight, STREAMS)), x)
    combined, _ = gr.combine(hyper, block_out, logits)
    step = StreamNormInputs(hyper, gr.hc_norm.weight, 1e-6, STREAMS, block_out, logits)
    _close(stream_norm_triton(step)[1], combined)


def test_gated_residual_on_the_cuda_path_computes_its_cpu_path() -> None:
    """The module's CUDA branches (the kernels) give its CPU path's block input, injection logits and combined
    streams, with the next site's norm taken in the same launch."""
    from dgpp.bench.launches import cuda_path
    from dgpp_qwen.layers.gated_residual import GatedResidual

    g = torch.Generator().manual_seed(4)
    gr, following = (GatedResidual(HIDDEN, STREAMS, RANK, 1e-6, dtype=torch.float32) for _ in range(2))
    for p in (*gr.parameters(), *following.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hyper = torch.randn(2, STREAMS * HIDDEN, generator=g)
    block_out = torch.randn(2, HIDDEN, generator=g)
    with cuda_path():
        x, logits = gr.mix(hyper)
        combined, normed = gr.combine(hyper, block_out, logits, then=following)
    ref_x, ref_logits = gr.mix(hyper)
    ref_combined, none = gr.combine(hyper, block_out, ref_logits, then=following)
    assert none is None and normed is not None
    _close(x, ref_x)
    _close(logits, ref_logits)
    _close(combined, ref_combined)
    _close(normed, following.hc_norm(ref_combined))
