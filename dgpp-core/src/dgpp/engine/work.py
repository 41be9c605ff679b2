"""What the scheduler asks the model runner to compute, per sequence, in one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dgpp.media.prompt import PromptMedia
from dgpp.sample.params import SamplingParams
from dgpp.sample.sampler import ChoiceSampler


@dataclass
class SeqWork:
    """Feed ``token_ids`` at positions ``context_len..`` of the sequence in ``state_slot`` / ``block_table``;
    logits of the last row (``want_logits``), or of every row (``every_row_logits``: a speculative verify)."""

    state_slot: int
    block_table: list[int]
    context_len: int
    token_ids: list[int]
    want_logits: bool = True
    every_row_logits: bool = False
    media: PromptMedia | None = None  # the sequence's images and rotary positions (a prompt with images)


class StepRunner(Protocol):
    """The runner contract: one forward over several sequences; fp32 logits for rows with ``want_logits``."""

    def step(self, works: list[SeqWork]) -> torch.Tensor: ...

    # a runner that also takes ``step(works, input_ids=device_ids)`` (a decode-only step's tokens as a device
    # tensor, replacing the works' token_ids) can run overlapped decode steps (dgpp.sched.overlap)


class DecodingSequence(Protocol):
    """What speculative decoding (``dgpp.engine.speculative``) reads and advances of a sequence the scheduler
    hands it (``dgpp.sched.request.Sequence``): its cache place, progress, sampling and output."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sampler: ChoiceSampler
    slot: int | None
    block_table: list[int]
    computed: int
    output: list[int]
    retired: Any  # None while live
    draft_state: Any  # the drafter's per-request record: a lookup index, the schedule's outcomes (None until first used)
    media: PromptMedia | None  # a prompt with images: its rotary positions continue into the output

    @property
    def tokens(self) -> list[int]: ...
