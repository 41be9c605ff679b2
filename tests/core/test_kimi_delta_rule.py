"""The gated delta rule with a decay per key channel (Kimi delta attention) vs transformers' glm5_next torch forms
(recurrent and chunked), fp32: varlen prefill in pieces and one-token decode over pooled state."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next.modeling_glm5_next import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from dgpp.nn.gated_delta_rule import gated_delta_rule_varlen

H, D = 3, 8


def _inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(length, H, D, generator=gen) for _ in range(3))
    g = -5.0 * torch.rand(length, H, D, generator=gen)  # KDA's safe gate: log decay in (-5, 0) per channel
    beta = torch.rand(length, H, generator=gen)
    return q, k, v, g, beta


def _recurrent(seq, initial):
    q, k, v, g, beta = (x[None] for x in seq)
    out, state = recurrent_kimi_delta_attention(
        q, k, v, g, beta, initial_state=initial[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    return out[0], state[0]


@pytest.mark.parametrize("pieces", [[70], [5, 1, 1, 40, 23], [1] * 9])
def test_varlen_pieces_match_the_recurrent_form(pieces):
    seq = _inputs(sum(pieces), seed=len(pieces))
    initial = torch.randn(H, D, D) * 0.3
    pool = torch.zeros(2, H, D, D)
    pool[1] = initial
    outs, done = [], 0
    for n in pieces:  # context > 0 throughout: the slot's state is read, not zeros
        part = [x[done : done + n] for x in seq]
        outs.append(gated_delta_rule_varlen(*part, pool, torch.tensor([1]), [n], [done + 1], 16))
        done += n
    ref_out, ref_state = _recurrent(seq, initial)
    torch.testing.assert_close(torch.cat(outs), ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[1], ref_state, rtol=1e-4, atol=1e-5)


def test_chunked_matches_transformers_chunked_form():
    seq = _inputs(150, seed=3)
    initial = torch.randn(H, D, D) * 0.3
    pool = initial[None].clone()
    out = gated_delta_rule_varlen(*seq, pool, torch.tensor([0]), [150], [1])
    q, k, v, g, beta = (x[None] for x in seq)
    ref, state = chunk_kimi_delta_attention(
        q, k, v, g, beta, initial_state=initial[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[0], state[0], rtol=1e-4, atol=1e-5)


def test_equal_channels_reduce_to_the_per_head_form():
    """A per-channel decay equal across a head's channels is the per-head (GDN) rule."""
    q, k, v, g, beta = _inputs(37, seed=5)
    per_head = g[..., 0]
    runs = []
    for decay in (per_head[..., None].expand(-1, -1, D).contiguous(), per_head):
        pool = torch.zeros(1, H, D, D)
        runs.append((gated_delta_rule_varlen(q, k, v, decay, beta, pool, torch.tensor([0]), [37], [0]), pool))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-5, atol=1e-6)
