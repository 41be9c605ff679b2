"""Varlen causal conv1d with pooled state vs transformers' qwen3_5 torch fallbacks (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

from dgpp.nn.causal_conv1d import causal_conv1d_varlen

CHANNELS, KERNEL = 24, 4


def _reference(x_seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[L, C] -> [L, C] whole-sequence conv from zeros, transformers' layout."""
    return causal_conv1d_fn(x_seq.T[None], weight, None, activation="silu")[0].T


def _run_in_pieces(x_seqs, weight, splits, num_slots=8):
    """Feed each sequence in the given pieces (one batch per step, all sequences together)."""
    pool = torch.randn(num_slots, KERNEL - 1, CHANNELS)  # garbage: fresh sequences must ignore it
    slots = torch.tensor([5, 2, 7][: len(x_seqs)])
    done = [0] * len(x_seqs)
    outs: list[list[torch.Tensor]] = [[] for _ in x_seqs]
    for step in range(max(len(s) for s in splits)):
        live = [i for i in range(len(x_seqs)) if step < len(splits[i])]
        q_lens = [splits[i][step] for i in live]
        rows = torch.cat([x_seqs[i][done[i] : done[i] + n] for i, n in zip(live, q_lens, strict=False)])
        y = causal_conv1d_varlen(rows, weight, None, pool, slots[live], q_lens, [done[i] for i in live])
        for i, piece in zip(live, torch.split(y, q_lens), strict=False):
            outs[i].append(piece)
            done[i] += piece.shape[0]
    return [torch.cat(o) for o in outs], pool, slots


@pytest.mark.parametrize(
    "splits",
    [
        [[7], [1], [12]],  # one shot, including a 1-token and a shorter-than-kernel prompt
        [[2, 5, 1, 1], [1, 1, 1], [3, 9, 1]],  # chunked prefill then decode steps
        [[1] * 6, [2, 1], [5, 5, 1, 1, 1]],
    ],
)
def test_conv_matches_reference_for_any_split(splits):
    torch.manual_seed(0)
    weight = torch.randn(CHANNELS, KERNEL)
    x_seqs = [torch.randn(sum(s), CHANNELS) for s in splits]
    outs, pool, slots = _run_in_pieces(x_seqs, weight, splits)
    for x, y, slot in zip(x_seqs, outs, slots, strict=False):
        torch.testing.assert_close(y, _reference(x, weight), rtol=1e-5, atol=1e-6)
        # the state is the last K-1 inputs, zero-padded on the left for short sequences
        expected_state = torch.cat([torch.zeros(KERNEL - 1, CHANNELS), x])[-(KERNEL - 1) :]
        torch.testing.assert_close(pool[slot], expected_state, rtol=0, atol=0)


def test_conv_bias_and_bad_shapes():
    torch.manual_seed(1)
    weight, bias = torch.randn(CHANNELS, KERNEL), torch.randn(CHANNELS)
    x = torch.randn(5, CHANNELS)
    pool = torch.zeros(2, KERNEL - 1, CHANNELS)
    y = causal_conv1d_varlen(x, weight, bias, pool, torch.tensor([0]), [5], [0], activation=None)
    ref = causal_conv1d_fn(x.T[None], weight, bias, activation=None)[0].T
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_varlen(x, weight, None, torch.zeros(2, KERNEL, CHANNELS), torch.tensor([0]), [5], [0])
