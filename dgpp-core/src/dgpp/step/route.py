"""A step's route: which rows of one model step take the canonical (row-exact) CUDA kernels.

The engine decides the route once per step from the rows' sequence lengths (``route_for``) and the policy
(``dgpp.policy``), and hands it over on the step's ``ForwardBatch`` (``batch.route``): layers that get the batch
read it there. Linears, the MoE router and the LM head are called with their rows only; they read the route of
the step in flight (``in_flight``), which is the batch's, set by the engine for the duration of the forward.
What each route means for the kernels is ``dgpp.nn.exact``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from dgpp.policy import current


@dataclass(frozen=True)
class StepRoute:
    """One step's routing: ``per_row`` (every row canonical; multi-row sequences run row by row), or the
    canonical (decode) rows' indices ``exact_rows`` (device) and each bulk (prefill-chunk) sequence's row range
    ``bulk_ranges`` of a step with prefill chunks.

    For dense linears a chunk's kernel may follow its own length: chunks of at most the policy's
    ``exact_group_rows`` rows join the decode rows in the fixed-order kernel (one call over all of them),
    longer chunks keep calls of their own. ``long_ranges`` are the latter's row ranges; ``fixed_rows`` the rows
    of the former (device), None when every row of the step is one (no long chunk) or none is."""

    num_tokens: int
    per_row: bool
    exact_rows: torch.Tensor | None = None
    exact_seqs: tuple[int, ...] = ()
    bulk_seqs: tuple[int, ...] = ()
    bulk_ranges: tuple[tuple[int, int], ...] = ()
    # device copies for the attention of a step with chunks and decode rows (built once per step, not per layer)
    exact_seq_index: torch.Tensor | None = None
    bulk_rows: torch.Tensor | None = None
    bulk_seq_index: torch.Tensor | None = None
    bulk_query_starts: torch.Tensor | None = None
    long_ranges: tuple[tuple[int, int], ...] = ()
    fixed_rows: torch.Tensor | None = None

    @property
    def all_exact(self) -> bool:
        return self.per_row or not self.bulk_seqs

    @property
    def none_exact(self) -> bool:
        return not self.per_row and not self.exact_seqs


def route_for(
    q_lens: list[int], device: torch.device | str, *, per_row: bool = False, group_rows: int | None = None
) -> StepRoute:
    """The route of a step whose sequences have ``q_lens`` rows (host list: no device sync); ``per_row``: every
    row canonical (a speculative verify, or ``batch_invariant``); ``group_rows`` overrides the policy's
    ``exact_group_rows`` (the longest chunk whose linears join the fixed-order call)."""
    total = sum(q_lens)
    if per_row or all(n == 1 for n in q_lens):
        return StepRoute(total, per_row=True)
    exact_seqs = tuple(i for i, n in enumerate(q_lens) if n == 1)
    bulk_seqs = tuple(i for i, n in enumerate(q_lens) if n > 1)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    ranges = tuple((starts[i], starts[i + 1]) for i in bulk_seqs)

    def index(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    group = current().exact_group_rows if group_rows is None else group_rows
    long_ranges = tuple((a, b) for a, b in ranges if b - a > group)
    fixed_rows = None
    if long_ranges and len(long_ranges) < len(q_lens):  # some rows fixed, some in long chunks: their indices
        short = [i for i, n in enumerate(q_lens) if n == 1 or n <= group]
        fixed_rows = index([r for i in short for r in range(starts[i], starts[i + 1])])
    if not exact_seqs:
        return StepRoute(
            total, False, None, exact_seqs, bulk_seqs, ranges, long_ranges=long_ranges, fixed_rows=fixed_rows
        )

    query_starts = [0]
    for a, b in ranges:
        query_starts.append(query_starts[-1] + b - a)
    return StepRoute(
        total,
        False,
        index([starts[i] for i in exact_seqs]),
        exact_seqs,
        bulk_seqs,
        ranges,
        exact_seq_index=index(list(exact_seqs)),
        bulk_rows=index([r for a, b in ranges for r in range(a, b)]),
        bulk_seq_index=index(list(bulk_seqs)),
        bulk_query_starts=index(query_starts, torch.int32),
        long_ranges=long_ranges,
        fixed_rows=fixed_rows,
    )


def step_route(input_ids: torch.Tensor, q_lens: list[int], *, verify: bool = False) -> StepRoute | None:
    """The route of a step over ``input_ids`` with ``q_lens`` rows per sequence: None off CUDA or with routing
    off (``dgpp.policy``); every row canonical in a speculative verify (``verify``) or under batch invariance."""
    policy = current()
    if not (input_ids.is_cuda and policy.exact_routing):
        return None
    return route_for(q_lens, input_ids.device, per_row=policy.batch_invariant or verify)


# the route of the step in flight, per thread (an engine steps on its own thread)
_FLIGHT: ContextVar[StepRoute | None] = ContextVar("dgpp_step_route", default=None)


@contextmanager
def in_flight(route: StepRoute | None) -> Iterator[None]:
    """``route`` (a batch's) is the step in flight for the layers inside that are called without the batch."""
    token = _FLIGHT.set(route)
    try:
        yield
    finally:
        _FLIGHT.reset(token)


def current_route() -> StepRoute | None:
    """The route of the step in flight (None outside a model step, off CUDA or with routing off)."""
    return _FLIGHT.get()
