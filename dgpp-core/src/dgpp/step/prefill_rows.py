"""Which rows of a step the lossy prefill levers (``engine.prefill_bf16_partials``, ``engine.prefill_fp8_gemm``) act on.

The levers change the arithmetic of prompt rows only, as the original engine's act on its prefill launches alone:
on CUDA they are the rows of prefill chunks, the route's bulk rows (``dgpp.step.route``); decode rows, speculative
verify rows and every row under ``engine.batch_invariant`` keep the canonical kernels and their bits. The CPU
computes every row kind with one row-wise kernel, so a prompt row cut into a one-row chunk must stay the bits of
the same row inside a longer chunk: there the levers act on every row. Either way a row's arithmetic is a
function of the row alone, so chunked equals one-shot and solo equals batched with a lever on, as with it off.
"""

from __future__ import annotations

import torch

from dgpp.step.route import current_route

ALL_ROWS = "all"


def prefill_rows(x: torch.Tensor) -> torch.Tensor | str | None:
    """The rows of ``x`` (a step's rows, ``[T, ...]``) that a prefill lever acts on: ``ALL_ROWS``, None (no row),
    or the row indices (int64, on ``x``'s device) when a step mixes prefill chunks with canonical rows."""
    if not x.is_cuda:
        return ALL_ROWS
    route = current_route()
    if route is None:  # outside a model step or with routing off: no row is canonical
        return ALL_ROWS
    if x.shape[0] != route.num_tokens or route.all_exact:  # a row set of its own, or every row canonical
        return None
    if route.exact_rows is None:
        return ALL_ROWS
    return route.bulk_rows


def row_mask(rows: torch.Tensor | str | None, count: int, device: torch.device) -> torch.Tensor:
    """``prefill_rows``' answer as a boolean mask over ``count`` rows."""
    if rows is None:
        return torch.zeros(count, dtype=torch.bool, device=device)
    if isinstance(rows, str):
        return torch.ones(count, dtype=torch.bool, device=device)
    mask = torch.zeros(count, dtype=torch.bool, device=device)
    mask[rows] = True
    return mask
