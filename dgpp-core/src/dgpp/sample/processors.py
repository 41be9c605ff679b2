"""Logit processors that run before the distribution is shaped: penalties, logit bias, token mask.

All work on one fp32 row in place; the anchor's order is penalties → logit bias → mask.
"""

from __future__ import annotations

import torch


class TokenHistory:
    """What penalties look at for one choice: which ids the prompt holds, and how often each id was generated.

    Repetition penalty covers prompt and output (HF / vLLM convention); presence and frequency penalties
    cover the output only (OpenAI's definition).
    """

    def __init__(self, vocab_size: int, prompt_ids: list[int], track: bool) -> None:
        self.track = track
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        if track:
            self.counts = torch.zeros(vocab_size, dtype=torch.int32)
            self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool)
            ids = [t for t in prompt_ids if 0 <= t < vocab_size]
            if ids:
                self.prompt_seen[torch.tensor(ids, dtype=torch.long)] = True

    def add(self, token: int) -> None:
        if self.counts is not None and 0 <= token < self.counts.shape[0]:
            self.counts[token] += 1


def apply_penalties(
    row: torch.Tensor,
    history: TokenHistory,
    repetition: float,
    presence: float,
    frequency: float,
) -> None:
    if not history.track or history.counts is None or history.prompt_seen is None:
        return
    vocab = row.shape[0]
    counts = history.counts[:vocab]
    if repetition != 1.0:
        seen = history.prompt_seen[:vocab] | (counts > 0)
        # divide positive logits and multiply negative ones, so a seen token always becomes less likely
        penalized = torch.where(row > 0, row / repetition, row * repetition)
        row.copy_(torch.where(seen, penalized, row))
    if frequency != 0.0:
        row.sub_(counts.to(row.dtype) * frequency)
    if presence != 0.0:
        row.sub_((counts > 0).to(row.dtype) * presence)


def apply_logit_bias(row: torch.Tensor, bias_ids: torch.Tensor | None, bias_values: torch.Tensor | None) -> None:
    if bias_ids is None or bias_values is None:
        return
    row.index_add_(0, bias_ids, bias_values.to(row.dtype))


def apply_mask(row: torch.Tensor, allowed: torch.Tensor | None) -> None:
    """``allowed`` is a bool tensor over the vocabulary (True = may be emitted); masked ids get zero mass."""
    if allowed is None:
        return
    n = min(row.shape[0], allowed.shape[0])
    row[:n].masked_fill_(~allowed[:n].to(torch.bool), float("-inf"))
    if allowed.shape[0] < row.shape[0]:
        row[n:] = float("-inf")
