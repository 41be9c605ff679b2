"""Which CUDA kernel each row of a step takes, decided so that a row's bits depend on that row alone.

On CUDA a row's result depends on the kernel it goes through, and the stock dispatch picks kernels by
the step: decode-only steps take the split decode attention and the row-count-classed GEMV, any step with
a multi-row sequence the flash prefill kernel and cuBLAS (whose kernel depends on ``M``). So a speculative
verify row (one of 1+depth rows of its request) did not compute what plain decode computes for the same
token, and a one-token prefill chunk not what the one-shot prompt computes for its last row (bf16).

The rule here (``docs/architecture.md``, "Exactness on CUDA"): a row is *canonical* when it is a decode row
(its sequence has one row this step), a row of a speculative verify (``verify_step()``), or any row at all
under ``batch_invariant`` (engine key ``engine.batch_invariant`` / ``DGPP_BATCH_INVARIANT=1``). Canonical rows
take, whatever else shares the step:

- linears: ``dgpp.kernels.exact_gemm`` (one fixed-order tile for every row count);
- attention: ``dgpp.kernels.exact_attention`` (decode kernel with a pinned split count), each verify /
  prompt row as its own decode row over its sequence's table;
- gated DeltaNet / causal conv: the recurrent decode kernels, one step per row;
- the LM head: always the fixed-order kernel; fused MoE: one row block for every token count.

The other rows (prefill chunks, default mode) keep the fast kernels (cuBLAS, flash prefill, chunked GDN),
each chunk in calls of its own: a chunk row's bits then depend on its own chunk (length, position), never on
the decode rows or the other prompts' chunks sharing the step, so spec on / off and any admission timing
give the same prompt rows. (Costs a weight read per prefilling sequence per step: see the docs.) ``DGPP_EXACT=0`` turns the
routing off (the previous dispatch, for A/B timing).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dgpp.engine.batch import ForwardBatch

# engine-wide switch, the verify nesting depth, and the route of the model step in flight
_state: dict = {"batch_invariant": os.environ.get("DGPP_BATCH_INVARIANT", "0") == "1", "verify": 0, "route": None}


def routing_enabled() -> bool:
    return os.environ.get("DGPP_EXACT", "1") != "0"


def set_batch_invariant(on: bool) -> None:
    """Engine-wide: every row canonical (chunked prefill == one-shot, at the prefill's cost; see the docs)."""
    _state["batch_invariant"] = bool(on)


def batch_invariant() -> bool:
    return bool(_state["batch_invariant"])


@contextmanager
def verify_step() -> Iterator[None]:
    """The model steps inside are speculative verifies: every row computes what plain decode would."""
    _state["verify"] += 1
    try:
        yield
    finally:
        _state["verify"] -= 1


@dataclass(frozen=True)
class StepRoute:
    """One step's routing: ``per_row`` (every row canonical; multi-row sequences run row by row), or the
    canonical (decode) rows' indices ``exact_rows`` (device) and each bulk (prefill-chunk) sequence's row range
    ``bulk_ranges`` of a step with prefill chunks."""

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

    @property
    def all_exact(self) -> bool:
        return self.per_row or not self.bulk_seqs

    @property
    def none_exact(self) -> bool:
        return not self.per_row and not self.exact_seqs


def route_for(q_lens: list[int], device: torch.device | str) -> StepRoute:
    """The route of a step whose sequences have ``q_lens`` rows (host list: no device sync)."""
    total = sum(q_lens)
    if batch_invariant() or _state["verify"] or all(n == 1 for n in q_lens):
        return StepRoute(total, per_row=True)
    exact_seqs = tuple(i for i, n in enumerate(q_lens) if n == 1)
    bulk_seqs = tuple(i for i, n in enumerate(q_lens) if n > 1)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    ranges = tuple((starts[i], starts[i + 1]) for i in bulk_seqs)
    if not exact_seqs:
        return StepRoute(total, False, None, exact_seqs, bulk_seqs, ranges)

    def index(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    query_starts = [0]
    for a, b in ranges:
        query_starts.append(query_starts[-1] + b - a)
    return StepRoute(
        total, False, index([starts[i] for i in exact_seqs]), exact_seqs, bulk_seqs, ranges,
        exact_seq_index=index(list(exact_seqs)), bulk_rows=index([r for a, b in ranges for r in range(a, b)]),
        bulk_seq_index=index(list(bulk_seqs)), bulk_query_starts=index(query_starts, torch.int32),
    )


@contextmanager
def routing(batch: ForwardBatch) -> Iterator[None]:
    """Route the model step over ``batch`` (the runner and the decode graphs wrap ``model(batch)`` in it)."""
    previous = _state["route"]
    on_cuda = batch.input_ids.is_cuda and routing_enabled()
    _state["route"] = route_for(batch.q_lens_cpu, batch.input_ids.device) if on_cuda else None
    try:
        yield
    finally:
        _state["route"] = previous


def current_route() -> StepRoute | None:
    return _state["route"]


def _pad_rows(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Weights with a row count that is not a multiple of 16 (small routers, tiny fixtures) padded with zero rows."""
    sizes = [w.shape[0] for w in weights]
    padded = [w if n % 16 == 0 else torch.nn.functional.pad(w, (0, 0, 0, -n % 16)) for w, n in zip(weights, sizes, strict=True)]
    return padded, sizes


def fixed_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The canonical linear of every row of ``x`` (any row count, any output size)."""
    from dgpp.kernels.exact_gemm import fixed_order_linear

    padded, sizes = _pad_rows([w.contiguous() for w in weights])
    outs = fixed_order_linear(x.contiguous(), padded)
    return [o[:, :n] if o.shape[1] != n else o for o, n in zip(outs, sizes, strict=True)]


def routable(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """``x``'s rows can follow the step's route: CUDA, routing on, a non-empty 2-D batch, and every dense
    weight (none for packed layers) of ``x``'s dtype and width."""
    return (x.is_cuda and routing_enabled() and x.dim() == 2 and x.shape[0] > 0
            and all(w.dim() == 2 and w.dtype == x.dtype and w.shape[1] == x.shape[1] for w in weights))


def route_rows(x: torch.Tensor, exact: Callable[[torch.Tensor], list[torch.Tensor]],
               bulk: Callable[[torch.Tensor], list[torch.Tensor]]) -> list[torch.Tensor] | None:
    """Split ``x``'s rows by the current step's route: ``exact(rows)`` for canonical rows, ``bulk(rows)`` for
    the rest (computed over the bulk rows only). None when no route is set (the caller's own path)."""
    route = current_route()
    if route is None:
        return exact(x) if batch_invariant() else None
    if x.shape[0] != route.num_tokens or route.all_exact:  # a row set of its own (e.g. logits rows): canonical
        return exact(x)
    if route.none_exact and len(route.bulk_ranges) == 1:
        return bulk(x)
    parts = [((a, b), bulk(x[a:b])) for a, b in route.bulk_ranges]
    exact_out = exact(x.index_select(0, route.exact_rows)) if route.exact_rows is not None else None
    first = parts[0][1] if parts else exact_out
    assert first is not None
    merged = [t.new_empty(x.shape[0], t.shape[1]) for t in first]
    for (a, b), outs in parts:
        for out, part in zip(merged, outs, strict=True):
            out[a:b] = part
    if exact_out is not None:
        for out, part in zip(merged, exact_out, strict=True):
            out.index_copy_(0, route.exact_rows, part)
    return merged


def routed_linears(x: torch.Tensor, weights: list[torch.Tensor], bulk: Callable[[torch.Tensor], list[torch.Tensor]],
                   bias: torch.Tensor | None = None) -> list[torch.Tensor] | None:
    """``[x @ w.T (+ bias)]`` for dense weights through the step's route, or None (not CUDA / routing off / no
    route). ``bias`` (one weight only) is added after the fixed-order product; ``bulk`` adds its own."""
    if not routable(x, weights):
        return None

    def exact(rows: torch.Tensor) -> list[torch.Tensor]:
        outs = fixed_linear(rows, weights)
        return outs if bias is None else [outs[0] + bias]

    return route_rows(x, exact, bulk)


def routed_gate_up_silu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                        bulk: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """``silu(x wg^T) * (x wu^T)`` through the step's route, or None."""
    from dgpp.kernels.exact_gemm import fixed_order_applies, fixed_order_gate_up_silu

    if not routable(x, [w_gate, w_up]):
        return None

    def exact(rows: torch.Tensor) -> list[torch.Tensor]:
        rows = rows.contiguous()
        if fixed_order_applies(rows, w_gate, w_up) and w_gate.shape == w_up.shape:
            return [fixed_order_gate_up_silu(rows, w_gate, w_up)]
        from dgpp import kernels

        # odd sizes (tiny fixtures): both projections padded, then the row-wise SwiGLU
        gate, up = fixed_linear(rows, [w_gate, w_up])
        return [kernels.silu_mul_pair(gate, up)]

    out = route_rows(x, exact, lambda rows: [bulk(rows)])
    return None if out is None else out[0]


def always_fixed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` through the fixed-order kernel for every row of every step (the LM head, MoE routers:
    few rows, and a token's logits / expert choice must never depend on the step), or None off CUDA / off."""
    if not routable(x, [weight]):
        return None
    return fixed_linear(x, [weight])[0]
