"""What the scheduler asks the model runner to compute, per sequence, in one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SeqWork:
    """Feed ``token_ids`` at positions ``context_len..`` of the sequence in ``state_slot`` / ``block_table``."""

    state_slot: int
    block_table: list[int]
    context_len: int
    token_ids: list[int]
    want_logits: bool = True


class StepRunner(Protocol):
    """The runner contract: one forward over several sequences; fp32 logits for rows with ``want_logits``."""

    def step(self, works: list[SeqWork]) -> torch.Tensor: ...
