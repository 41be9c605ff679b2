"""A deterministic stand-in for the model runner, for scheduler and API tests without a checkpoint.

It stores token ids in a paged "KV" pool through the block tables it is given, and (in hybrid mode) a
rolling hash per state slot, and derives each row's logits from what it reads back. A wrong block
table, a stale block or a bad state snapshot therefore changes the output, which is what the tests
of the prefix cache and the scheduler need to catch.
"""

from __future__ import annotations

from collections import deque

import torch

from dgpp.engine.work import SeqWork

_MOD = (1 << 61) - 1


class ToyRunner:
    """``step(works)`` -> fp32 logits ``[rows wanting logits, vocab]``, a pure function of each sequence's history."""

    def __init__(
        self,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        hybrid: bool = False,
        favour: dict[int, float] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.hybrid = hybrid
        self.kv = torch.full((num_blocks, block_size), -1, dtype=torch.int64)
        self.state = torch.zeros(num_state_slots, dtype=torch.int64)
        self.favour = favour or {}
        # (context_len, tokens) per work of the recent steps, for tests
        self.steps: deque[list[tuple[int, int]]] = deque(maxlen=10_000)

    def copy_state(self, src: int, dst: int) -> None:
        self.state[dst] = self.state[src]

    def step(self, works: list[SeqWork], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``: one token per (decode) work, replacing its ``token_ids`` (overlapped decode steps)."""
        self.steps.append([(w.context_len, len(w.token_ids)) for w in works])
        if input_ids is not None:
            works = [
                SeqWork(w.state_slot, w.block_table, w.context_len, [t], w.want_logits)
                for w, t in zip(works, input_ids.tolist(), strict=True)
            ]
        rows = []
        for w in works:
            if w.context_len == 0:
                self.state[w.state_slot] = 0
            for i, tok in enumerate(w.token_ids):
                pos = w.context_len + i
                block = w.block_table[pos // self.block_size]
                self.kv[block, pos % self.block_size] = tok
                if self.hybrid:
                    self.state[w.state_slot] = (int(self.state[w.state_slot]) * 1_000_003 + tok + 1) % _MOD
            if w.want_logits:
                rows.append(self._logits(w))
        if not rows:
            return torch.empty(0, self.vocab_size)
        return torch.stack(rows)

    def _logits(self, w: SeqWork) -> torch.Tensor:
        end = w.context_len + len(w.token_ids)
        positions = torch.arange(end)
        blocks = torch.tensor(w.block_table, dtype=torch.long)[positions // self.block_size]
        history = self.kv[blocks, positions % self.block_size].tolist()  # read back through the block table
        seed = 7
        for tok in history:
            seed = (seed * 1_000_003 + tok + 1) % _MOD
        if self.hybrid:
            seed = (seed ^ int(self.state[w.state_slot])) % _MOD
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(self.vocab_size, generator=gen) * 2.0
        for tok, bonus in self.favour.items():
            logits[tok] += bonus
        return logits
