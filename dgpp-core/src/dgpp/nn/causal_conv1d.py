"""Depthwise causal conv1d (+ SiLU) over varlen token rows, with each sequence's conv state in the state pool.

A sequence's conv state is its last ``kernel-1`` conv *inputs*, ``[kernel-1, channels]`` oldest first. The
output at a token mixes that token with the ``kernel-1`` inputs before it, so a sequence continued from its
state gives the same result as the whole sequence at once: prefill chunks and single decode steps are one path.
A sequence with ``context_len == 0`` starts from zeros whatever its slot holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.nn.batch_invariant import rows_elementwise
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.step.batch import ForwardBatch


def token_layout(q_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per flattened token row: its sequence index and its offset inside that sequence; plus each sequence's start.

    Built from host lengths so no device sync is needed.
    """
    lens = torch.tensor(q_lens, dtype=torch.int64, device=device)
    starts = torch.cumsum(lens, 0) - lens
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(q_lens), device=device), lens, output_size=sum(q_lens)
    )
    offset_in_seq = torch.arange(sum(q_lens), device=device) - starts[seq_of_token]
    return seq_of_token, offset_in_seq, starts


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    q_lens: list[int],
    context_lens: list[int],
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over every sequence of a batch; updates ``conv_state`` in place.

    x: ``[T, C]`` token rows (sequence ``i`` owns ``q_lens[i]`` consecutive rows); weight: ``[C, K]``;
    conv_state: the pool tensor ``[num_slots, K-1, C]``; state_slots: ``[B]`` slot per sequence.
    Returns ``[T, C]`` in ``x``'s dtype (accumulated in fp32, rounded once, then the activation).
    """
    num_tokens, channels = x.shape
    kernel = weight.shape[-1]
    hist_len = kernel - 1
    if weight.shape[0] != channels or conv_state.shape[1:] != (hist_len, channels):
        raise ValueError(
            f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)} and conv_state "
            f"{tuple(conv_state.shape)} disagree on channels/kernel"
        )
    num_seqs = len(q_lens)
    device = x.device
    seq_of_token, offset_in_seq, starts = token_layout(q_lens, device)

    # History rows of every sequence, zeros for sequences that start here.
    fresh = torch.tensor([c == 0 for c in context_lens], dtype=torch.bool, device=device)
    history = conv_state[state_slots].to(x.dtype)
    history = torch.where(fresh[:, None, None], torch.zeros_like(history), history)

    # One source of rows: the new inputs, then every sequence's history. Sequence i's extended input
    # ``[history_i | x_i]`` at extended index m (0 <= m < K-1+L_i) maps to a row of this source.
    source = torch.cat([x, history.reshape(num_seqs * hist_len, channels)], dim=0)

    def source_row(seq: torch.Tensor, ext_index: torch.Tensor) -> torch.Tensor:
        from_history = num_tokens + seq * hist_len + ext_index
        from_input = starts[seq] + ext_index - hist_len
        return torch.where(ext_index < hist_len, from_history, from_input)

    taps = torch.arange(kernel, device=device)
    window_rows = source_row(seq_of_token[:, None], offset_in_seq[:, None] + taps[None, :])  # [T, K]
    # one tap at a time: a [T, C] fp32 accumulator instead of a [T, K, C] window tensor (prefill chunks are big)
    wf = weight.float()
    out = torch.zeros(num_tokens, channels, dtype=torch.float32, device=device)
    for tap in range(kernel):
        out += source[window_rows[:, tap]].float() * wf[:, tap]
    if bias is not None:
        out = out + bias.float()
    out = out.to(x.dtype)
    if activation == "silu":
        out = rows_elementwise(F.silu, out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: unsupported activation {activation!r}")

    # New state: the last K-1 rows of each extended input (gathered before the pool is written).
    lens = torch.tensor(q_lens, dtype=torch.int64, device=device)
    tail = lens[:, None] + torch.arange(hist_len, device=device)[None, :]  # extended indices L_i .. L_i+K-2
    seqs = torch.arange(num_seqs, device=device)[:, None].expand(-1, hist_len)
    new_state = source[source_row(seqs, tail)]
    conv_state[state_slots] = new_state.to(conv_state.dtype)
    return out


class CausalConv1d(nn.Module):
    """Depthwise causal conv layer whose per-sequence history lives in the state pool (``conv_state``).

    ``weight`` is ``[channels, 1, kernel]`` as checkpoints store it (``conv1d.weight``)."""

    def __init__(self, channels: int, kernel: int, *, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.channels = channels
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, weight_loader=default_weight_loader)
        else:
            self.register_parameter("bias", None)

    def state_shape(self) -> tuple[int, int]:
        return (self.kernel - 1, self.channels)

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch, activation: str | None = "silu"
    ) -> torch.Tensor:
        if activation not in ("silu", None):
            raise ValueError(f"causal_conv1d: unsupported activation {activation!r}")
        weight = self.weight[:, 0, :]
        if batch.is_decode_only and (x.is_cuda or bool((batch.state_slots < 0).any())):
            # one token per sequence: the step that reads only device tensors (CUDA-graph safe) and
            # leaves padding rows (slot -1) alone
            from dgpp.kernels.causal_conv1d import causal_conv1d_decode

            return causal_conv1d_decode(
                x,
                weight,
                self.bias,
                conv_state,
                batch.state_slots,
                batch.fresh_flags(),
                activation == "silu",
            )
        return causal_conv1d_varlen(
            x,
            weight,
            self.bias,
            conv_state,
            batch.state_slots,
            batch.q_lens_cpu,
            batch.context_lens_cpu,
            activation,
        )
