"""One sequence in the scheduler: a choice of a request (``dgpp.sched.thread_handoff.GenerationRequest``), built
on the step loop's thread, from admission to retirement; the events it sends back and their timing."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dgpp.media.prompt import PromptMedia
from dgpp.sample.params import SamplingParams
from dgpp.sample.sampler import ChoiceSampler, SampleResult


class RetireReason(enum.Enum):
    """Why a sequence stopped (``/metrics`` counts retirements by these values)."""

    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"  # a stop string matched (the serving layer asked for it)
    CANCELLED = "cancelled"
    POOL_EXHAUSTED = "pool_exhausted"
    FAILED = "failed"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class SeqTiming(NamedTuple):
    """When a choice arrived, was admitted, and emitted its first and latest token (``time.monotonic``), and
    its token counts so far: what the HTTP side reports (``timings``, the request histograms) without
    reading the scheduler's ``Sequence``."""

    arrival: float
    admitted_at: float | None
    first_token_at: float | None
    last_token_at: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass
class SeqEvent:
    """What the step loop thread tells the serving side after a tick: new tokens and maybe the end, with the
    choice's timing as of this event."""

    tokens: list[int]
    samples: list[SampleResult]
    retired: RetireReason | None = None
    cached_tokens: int = 0
    error: str | None = None
    timing: SeqTiming | None = None


EventSink = Callable[["Sequence", SeqEvent], None]


@dataclass(eq=False)
class Sequence:
    """A choice being generated. ``seq_id`` is its admission-order key: decode rows follow it."""

    request_id: str
    choice_index: int
    prompt: list[int]
    params: SamplingParams
    sampler: ChoiceSampler
    sink: EventSink
    use_prefix_cache: bool = True
    # choice 0 of an n > 1 request: the other choices wait for its prefill, then attach to it through
    # the prefix cache, so the shared prompt is computed once
    leader: Sequence | None = None
    block_keys: list[bytes] | None = None  # prefix-cache keys of the prompt, computed once
    # what the sampler's grammar mask was built from (``Backend.constraint_matcher``'s input), so
    # tensor-parallel peers can build the same matcher from the journal; None when unconstrained
    constraint: dict[str, Any] | None = None
    seq_id: int = -1
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV / state is in the cache
    cached_tokens: int = 0  # of those, how many came from the prefix cache
    output: list[int] = field(default_factory=list)
    retired: RetireReason | None = None
    draft_state: Any = (
        None  # engine.draft "lookup": the request's drafting state (dgpp.engine.lookup_draft.LookupState)
    )
    # a prompt with images: their pixels and placeholder spans, and the prompt's rotary positions
    media: PromptMedia | None = None
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def cache_tokens(self) -> list[int]:
        """What the prefix cache keys and compares: the prompt, with image placeholders standing for their pixels."""
        return self.prompt if self.media is None else self.media.key_tokens(self.prompt)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_len + self.params.max_tokens

    @property
    def remaining_prefill(self) -> int:
        return max(0, self.prompt_len - self.computed)

    def timing(self) -> SeqTiming:
        return SeqTiming(
            self.arrival,
            self.admitted_at,
            self.first_token_at,
            self.last_token_at,
            len(self.prompt),
            self.cached_tokens,
            len(self.output),
        )
