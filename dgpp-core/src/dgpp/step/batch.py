"""ForwardBatch: one model step over several sequences, some in prefill and some in decode.

Token rows are flattened (varlen). Sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
at positions ``context_lens[i] .. seq_lens[i]-1``; its earlier tokens are already in the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from dgpp.media.prompt import PromptMedia
from dgpp.step.pools import CachePools
from dgpp.step.route import StepRoute

T = TypeVar("T")


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    context_lens: torch.Tensor  # [B] int32, tokens already cached before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    slot_mapping: torch.Tensor  # [T] int64, flat K/V slot (block*block_size+offset); -1 writes nothing
    state_slots: torch.Tensor  # [B] int64, state pool slot of each sequence
    logits_indices: torch.Tensor  # [R] int64, rows whose hidden state forward() returns
    cache: CachePools
    # host copies, so torch paths can loop over sequences without device syncs
    q_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    # which rows take the canonical CUDA kernels this step (set by the engine; None off CUDA / routing off)
    route: StepRoute | None = None
    # prompts with images (dgpp.media.prompt.PromptMedia), one entry per sequence (None for a text one); the
    # whole field is None when no sequence of the step has images
    media: list[PromptMedia | None] | None = None
    # [axes, T] multimodal rotary positions of the rows (``positions`` on every axis for text sequences); None
    # when no sequence of the step has images
    rope_positions: torch.Tensor | None = None
    # values the layers derive from the batch once a step (e.g. the CPU's K/V write slots); ``step_memo``
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def step_memo(self, key: Any, compute: Callable[[], T]) -> T:
        """``compute()``, evaluated once per batch and ``key``: what every layer of a step would otherwise
        recompute from the same batch tensors. Whoever replaces one of the batch's tensors clears the memo."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def fresh_flags(self) -> torch.Tensor:
        """``[B]`` int8, 1 where the sequence starts this step (``context_lens == 0``): the recurrent and conv
        kernels' flag, computed once a step for every layer."""
        return self.step_memo("fresh_flags", lambda: (self.context_lens == 0).to(torch.int8))

    @property
    def rotary_positions(self) -> torch.Tensor:
        """What rotary layers rotate by: ``rope_positions`` when the step has images, else ``positions``."""
        return self.positions if self.rope_positions is None else self.rope_positions

    def sequence_rotary_positions(self, i: int, length: int) -> torch.Tensor:
        """Rotary positions of sequence ``i``'s tokens ``0 .. length`` (``[axes, length]`` for a prompt with
        images, else ``[length]``), for layers that rotate keys of earlier tokens."""
        media = None if self.media is None else self.media[i]
        if media is None:
            return torch.arange(length, device=self.positions.device)
        return media.positions(0, length).to(self.positions.device)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens_cpu)
