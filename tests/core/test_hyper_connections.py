"""Manifold-constrained hyper-connections (``dgpp.nn.hyper_connections``) against transformers' DeepSeek-V4
modules: the same random fp32 weights in, a whole decoder layer's two passes and the head collapse out."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

from dgpp.nn import hyper_connections as hc_mod
from dgpp.nn.hyper_connections import HyperConnection, HyperHead, sinkhorn, to_streams

H, N, T = 32, 4, 7


def tiny_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=H,
        num_hidden_layers=1,
        hc_mult=N,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        vocab_size=64,
        num_attention_heads=2,
        head_dim=16,
        q_lora_rank=8,
        o_lora_rank=8,
        o_groups=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        index_n_heads=2,
        index_head_dim=8,
    )


def random_hc(gen: torch.Generator) -> dict[str, torch.Tensor]:
    # weights large enough that pre / post / comb are far from uniform (the init's std 0.02 is not)
    return {
        "fn": torch.randn((2 + N) * N, N * H, generator=gen) * 0.5,
        "base": torch.randn((2 + N) * N, generator=gen),
        "scale": torch.rand(3, generator=gen) + 0.5,
    }


class _Sublayer(nn.Module):
    """A stand-in for attention / MoE: a fixed nonlinear map of the collapsed row."""

    def __init__(self, gen: torch.Generator, *, returns_pair: bool) -> None:
        super().__init__()
        self.w = torch.randn(H, H, generator=gen) / H**0.5
        self.returns_pair = returns_pair

    def forward(self, x, input_ids=None, **_):
        y = torch.tanh(x @ self.w.T)
        return (y, None) if self.returns_pair else y


def _layer_pair(gen: torch.Generator):
    cfg = tiny_config()
    ref = hf.DeepseekV4DecoderLayer(cfg, 0)
    attn, mlp = _Sublayer(gen, returns_pair=True), _Sublayer(gen, returns_pair=False)
    ref.self_attn, ref.mlp = attn, mlp
    ours = [HyperConnection(H, N, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6) for _ in range(2)]
    for ref_hc, our_hc in zip((ref.attn_hc, ref.ffn_hc), ours, strict=True):
        for name, value in random_hc(gen).items():
            getattr(ref_hc, name).data.copy_(value)
            getattr(our_hc, name).data.copy_(value)
    for norm in (ref.input_layernorm, ref.post_attention_layernorm):
        norm.weight.data.copy_(torch.rand(H, generator=gen) + 0.5)

    def our_layer(streams: torch.Tensor) -> torch.Tensor:
        streams = ours[0](streams, lambda x: attn(ref.input_layernorm(x))[0])
        return ours[1](streams, lambda x: mlp(ref.post_attention_layernorm(x)))

    return ref, our_layer, ours


def test_decoder_layer_two_passes_match_transformers():
    gen = torch.Generator().manual_seed(0)
    ref, our_layer, _ = _layer_pair(gen)
    streams = torch.randn(T, N, H, generator=gen)
    with torch.no_grad():
        want = ref(streams.unsqueeze(0)).squeeze(0)
        got = our_layer(streams)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - streams).abs().max() > 0.1  # the layer did something


def test_head_collapse_matches_transformers():
    gen = torch.Generator().manual_seed(1)
    ref = hf.DeepseekV4HyperHead(tiny_config())
    ours = HyperHead(H, N, eps=1e-6, norm_eps=1e-6)
    values = {
        "hc_fn": torch.randn(N, N * H, generator=gen) * 0.5,
        "hc_base": torch.randn(N, generator=gen),
        "hc_scale": torch.rand(1, generator=gen) + 0.5,
    }
    for name, value in values.items():
        getattr(ref, name).data.copy_(value)
        getattr(ours, name).data.copy_(value)
    streams = torch.randn(T, N, H, generator=gen)
    with torch.no_grad():
        want = ref(streams.unsqueeze(0)).squeeze(0)
        got = ours(streams)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # weighted, not the plain mean of the streams
    assert (got - streams.mean(1)).abs().max() > 1e-2


def test_skipping_sinkhorn_moves_the_output(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    ref, our_layer, _ = _layer_pair(gen)
    streams = torch.randn(T, N, H, generator=gen)
    with torch.no_grad():
        want = ref(streams.unsqueeze(0)).squeeze(0)
        monkeypatch.setattr(hc_mod, "sinkhorn", lambda comb, iters, eps: comb)
        skipped = our_layer(streams)
    assert (skipped - want).abs().max() > 1e-3


def test_comb_is_doubly_stochastic_and_rows_are_independent():
    gen = torch.Generator().manual_seed(2)
    layer = HyperConnection(H, N)
    for name, value in random_hc(gen).items():
        getattr(layer, name).data.copy_(value)
    streams = torch.randn(T, N, H, generator=gen)
    with torch.no_grad():
        _, _, comb = layer.coefficients(streams)
        # the last pass normalizes columns; rows approach 1 at the finite iteration count
        torch.testing.assert_close(comb.sum(-2), torch.ones(T, N), rtol=0, atol=1e-5)
        assert (comb.sum(-1) - 1).abs().max() < 0.1
        # a token's mixing does not depend on the other rows of the step (bit for bit)
        x_all, post_all, comb_all = layer.collapse(streams)
        for t in (0, T - 1):
            x_one, post_one, comb_one = layer.collapse(streams[t : t + 1])
            assert torch.equal(x_one[0], x_all[t]) and torch.equal(comb_one[0], comb_all[t])


def test_sinkhorn_needs_positive_iterations_and_streams_shape():
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        HyperConnection(H, N, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="streams must be"):
        HyperHead(H, N)(torch.zeros(T, H))
    uniform = sinkhorn(torch.ones(1, N, N), 20, 0.0)
    torch.testing.assert_close(uniform, torch.full((1, N, N), 1.0 / N))
    assert to_streams(torch.arange(6.0).view(2, 3), N).shape == (2, N, 3)


def test_bf16_streams_follow_the_reference_rounding():
    """bf16 streams: fp32 coefficients, the update rounded as the reference rounds it (to bf16 tolerance)."""
    gen = torch.Generator().manual_seed(4)
    ref, our_layer, _ = _layer_pair(gen)
    streams = torch.randn(T, N, H, generator=gen).to(torch.bfloat16)
    ref.self_attn.w, ref.mlp.w = ref.self_attn.w.to(torch.bfloat16), ref.mlp.w.to(torch.bfloat16)
    for norm in (ref.input_layernorm, ref.post_attention_layernorm):
        norm.to(torch.bfloat16)
    with torch.no_grad():
        want = ref(streams.unsqueeze(0)).squeeze(0)
        got = our_layer(streams)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
