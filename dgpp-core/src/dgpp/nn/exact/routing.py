"""Which CUDA kernel each row of a step takes, decided so that a row's bits depend on that row alone.

On CUDA a row's result depends on the kernel it goes through, and the stock dispatch picks kernels by
the step: decode-only steps take the split decode attention and the row-count-classed GEMV, any step with
a multi-row sequence the flash prefill kernel and cuBLAS (whose kernel depends on ``M``). So a speculative
verify row (one of 1+depth rows of its request) did not compute what plain decode computes for the same
token, and a one-token prefill chunk not what the one-shot prompt computes for its last row (bf16).

The rule here (``docs/architecture.md``, "Exactness on CUDA"): a row is *canonical* when it is a decode row
(its sequence has one row this step), a row of a speculative verify (``ModelRunner.step(..., verify=True)``), or any row at all
under ``batch_invariant`` (engine key ``engine.batch_invariant``, ``dgpp.policy``). Canonical rows
take, whatever else shares the step:

- linears: ``dgpp.nn.exact.gemm`` (one fixed-order tile for every row count);
- attention: ``dgpp.nn.exact.attention`` (decode kernel with a pinned split count), each verify /
  prompt row as its own decode row over its sequence's table;
- gated DeltaNet / causal conv: the recurrent decode kernels, one step per row;
- the LM head: always the fixed-order kernel; fused MoE: one row block for every token count.

The other rows (prefill chunks, default mode) keep the fast kernels (cuBLAS, flash prefill, chunked GDN),
each chunk in calls of its own: a chunk row's bits then depend on its own chunk (length, position), never on
the decode rows or the other prompts' chunks sharing the step, so spec on / off and any admission timing
give the same prompt rows. (Costs a weight read per prefilling sequence per step: see the docs.) ``DGPP_EXACT=0`` turns the
routing off (the previous dispatch, for A/B timing).

Dense linears go one step further (``grouped`` below): the kernel of a chunk's rows is a function of the
chunk's own length, so chunks of at most ``exact_group_rows`` rows (the policy's; a burst of short prompts)
take the fixed-order kernel, whose rows do not depend on the call, in ONE call together with the decode rows;
longer chunks keep cuBLAS calls of their own (a lone long prompt keeps cuBLAS speed). A burst of 64 x 128-token
prompts then reads each weight once per layer instead of 64 times.

The route itself (which rows are canonical this step) is the engine's, on the step's batch: ``dgpp.step.route``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dgpp.nn.exact.chunks import chunk_gate_up_silu, chunk_linears
from dgpp.policy import current
from dgpp.step.route import current_route


def _pad_rows(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Weights with a row count that is not a multiple of 16 (small routers, tiny fixtures) padded with zero rows."""
    sizes = [w.shape[0] for w in weights]
    padded = [
        w if n % 16 == 0 else torch.nn.functional.pad(w, (0, 0, 0, -n % 16))
        for w, n in zip(weights, sizes, strict=True)
    ]
    return padded, sizes


def fixed_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The canonical linear of every row of ``x`` (any row count, any output size)."""
    from dgpp.nn.exact.gemm import fixed_order_linear

    padded, sizes = _pad_rows([w.contiguous() for w in weights])
    outs = fixed_order_linear(x.contiguous(), padded)
    return [o[:, :n] if o.shape[1] != n else o for o, n in zip(outs, sizes, strict=True)]


def routable(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """``x``'s rows can follow the step's route: CUDA, routing on, a non-empty 2-D batch, and every dense
    weight (none for packed layers) of ``x``'s dtype and width."""
    return (
        x.is_cuda
        and current().exact_routing
        and x.dim() == 2
        and x.shape[0] > 0
        and all(w.dim() == 2 and w.dtype == x.dtype and w.shape[1] == x.shape[1] for w in weights)
    )


BulkChunks = Callable[[torch.Tensor, tuple[tuple[int, int], ...]], "list[torch.Tensor] | None"]


def route_rows(
    x: torch.Tensor,
    exact: Callable[[torch.Tensor], list[torch.Tensor]],
    bulk: Callable[[torch.Tensor], list[torch.Tensor]],
    bulk_chunks: BulkChunks | None = None,
    *,
    grouped: bool = False,
) -> list[torch.Tensor] | None:
    """Split ``x``'s rows by the current step's route: ``exact(rows)`` for canonical rows, ``bulk(rows)`` for
    the rest (computed over the bulk rows only). None when no route is set (the caller's own path).

    ``bulk_chunks(x, ranges)``, when given, computes every prefill chunk's rows at once into full-height outputs
    (each chunk still in calls of its own, written in place: the same products ``bulk`` makes, without a copy
    per chunk and output); it may return None to leave the chunks to ``bulk``. ``grouped``: ``exact`` is fast at
    prefill size (the dense fixed-order kernel), so the rows of short chunks join the canonical rows' call and
    only the route's ``long_ranges`` go to ``bulk``."""
    route = current_route()
    if route is None:
        return exact(x) if current().batch_invariant else None
    if (
        x.shape[0] != route.num_tokens or route.all_exact
    ):  # a row set of its own (e.g. logits rows): canonical
        return exact(x)
    ranges, rows = (route.long_ranges, route.fixed_rows) if grouped else (route.bulk_ranges, route.exact_rows)
    if not ranges:  # decode rows and short chunks only: one fixed-order call over the step
        return exact(x)
    if rows is None and len(ranges) == 1 and ranges[0] == (0, x.shape[0]):
        return bulk(x)
    exact_out = exact(x.index_select(0, rows)) if rows is not None else None
    merged = bulk_chunks(x, ranges) if bulk_chunks is not None else None
    if merged is None:
        merged = _merged_bulk(x, ranges, bulk, exact_out)
    if exact_out is not None:
        for out, part in zip(merged, exact_out, strict=True):
            out.index_copy_(0, rows, part)
    return merged


def _merged_bulk(
    x: torch.Tensor,
    ranges: tuple[tuple[int, int], ...],
    bulk: Callable[[torch.Tensor], list[torch.Tensor]],
    exact_out: list[torch.Tensor] | None,
) -> list[torch.Tensor]:
    parts = [((a, b), bulk(x[a:b])) for a, b in ranges]
    first = parts[0][1] if parts else exact_out
    assert first is not None
    merged = [t.new_empty(x.shape[0], t.shape[1]) for t in first]
    for (a, b), outs in parts:
        for out, part in zip(merged, outs, strict=True):
            out[a:b] = part
    return merged


def routed_linears(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    bulk: Callable[[torch.Tensor], list[torch.Tensor]],
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor] | None:
    """``[x @ w.T (+ bias)]`` for dense weights through the step's route, or None (not CUDA / routing off / no
    route). ``bias`` (one weight only) is added after the fixed-order product; ``bulk`` adds its own."""
    if not routable(x, weights):
        return None

    def exact(rows: torch.Tensor) -> list[torch.Tensor]:
        outs = fixed_linear(rows, weights)
        return outs if bias is None else [outs[0] + bias]

    def chunks(rows: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> list[torch.Tensor] | None:
        return chunk_linears(rows, weights, ranges) if bias is None else None

    return route_rows(x, exact, bulk, chunks, grouped=True)


def routed_gate_up_silu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, bulk: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """``silu(x wg^T) * (x wu^T)`` through the step's route, or None."""
    from dgpp.nn.exact.gemm import fixed_order_applies, fixed_order_gate_up_silu

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

    out = route_rows(
        x,
        exact,
        lambda rows: [bulk(rows)],
        lambda rows, ranges: chunk_gate_up_silu(rows, w_gate, w_up, ranges),
        grouped=True,
    )
    return None if out is None else out[0]


def always_fixed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` through the fixed-order kernel for every row of every step (the LM head, MoE routers:
    few rows, and a token's logits / expert choice must never depend on the step), or None off CUDA / off."""
    if not routable(x, [weight]):
        return None
    return fixed_linear(x, [weight])[0]
