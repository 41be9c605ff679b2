"""Logit processors that run before the distribution is shaped: penalties, logit bias, token mask.

All work on one fp32 row in place, in the order penalties → logit bias → mask.
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
        self.vocab_size = vocab_size
        self._prompt_ids = [t for t in prompt_ids if 0 <= t < vocab_size] if track else []
        self._pending: list[int] = []  # tokens accepted before the tensors exist
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None

    def materialize(self, device: torch.device) -> None:
        """Build the tensors on the logits' device the first time penalties run (GPU rows stay on the GPU)."""
        if not self.track or self.counts is not None:
            return
        self.counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
        if self._prompt_ids:
            self.prompt_seen[torch.tensor(self._prompt_ids, dtype=torch.long, device=device)] = True
        for t in self._pending:
            self.counts[t] += 1
        self._pending = []

    def add(self, token: int) -> None:
        if not self.track or not 0 <= token < self.vocab_size:
            return
        if self.counts is None:
            self._pending.append(token)
        else:
            self.counts[token] += 1

    def extended(self, tokens: tuple[int, ...], device: torch.device) -> TokenHistory:
        """A copy that has also seen ``tokens`` (a verify row's earlier drafts, emitted only if they stand)."""
        if not self.track or not tokens:
            return self
        self.materialize(device)
        assert self.counts is not None
        copy = TokenHistory(self.vocab_size, [], False)
        copy.track, copy.prompt_seen = True, self.prompt_seen
        ids = torch.tensor([t for t in tokens if 0 <= t < self.vocab_size], dtype=torch.long, device=device)
        copy.counts = self.counts.index_add(0, ids, torch.ones_like(ids, dtype=self.counts.dtype))
        return copy


def apply_penalties(
    row: torch.Tensor,
    history: TokenHistory,
    repetition: float,
    presence: float,
    frequency: float,
) -> None:
    if not history.track:
        return
    history.materialize(row.device)
    assert history.counts is not None and history.prompt_seen is not None
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


def apply_logit_bias(
    row: torch.Tensor, bias_ids: torch.Tensor | None, bias_values: torch.Tensor | None
) -> None:
    if bias_ids is None or bias_values is None:
        return
    row.index_add_(0, bias_ids.to(row.device), bias_values.to(device=row.device, dtype=row.dtype))


def apply_mask(row: torch.Tensor, allowed: torch.Tensor | None) -> None:
    """``allowed`` is a bool tensor over the vocabulary (True = may be emitted); masked ids get zero mass."""
    if allowed is None:
        return
    n = min(row.shape[0], allowed.shape[0])
    row[:n].masked_fill_(~allowed[:n].to(device=row.device, dtype=torch.bool), float("-inf"))
    if allowed.shape[0] < row.shape[0]:
        row[n:] = float("-inf")
