"""Paged decode attention whose every row depends on that row alone (its query, ``seq_len`` and table).

``paged_decode_attention_triton`` sizes its split grid from the batch and the table width
(``plan_partition``), and each sequence spreads its context over that many splits: a row's partial sums,
and so its last bit, change with how many other rows share the step. Here the grid always has
``exact_splits`` splits (``dgpp.policy``, 32), so a sequence's cut (``BLOCK_N``-token multiples, decided on the device from its
``seq_len``) and the merge's reduction width are the same in every step: plain decode at any batch size,
a speculative verify's rows (each its own decode row) and a prompt run row by row all agree bit for bit.
The launch is ``dgpp.kernels.paged_attention.decode_attention_with_splits``; only the split count is
pinned. Contexts up to ``BLOCK_N`` tokens are written directly by split 0, longer ones merged over at most
``exact_splits`` parts.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import next_pow2
from dgpp.kernels.kv_fp8 import KVScales
from dgpp.kernels.paged_attention import decode_attention_with_splits, programs_per_row
from dgpp.policy import current
from dgpp.step.batch import ForwardBatch
from dgpp.step.route import StepRoute, route_for

# fp32 split partials one call may hold when a whole prompt runs row by row (rows x heads x splits x value
# dim): 256 rows of 32 heads x 128 at 32 splits, 128 MiB
_PARTIALS_PER_CALL = 256 * 32 * 32 * 128


def paged_decode_attention_fixed(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    splits: int | None = None,
    scales: KVScales = None,
    sinks: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` with ``splits`` fixed (rows independent of the batch and table width).
    The programs per (row, KV head) follow the batch (``programs_per_row``): that never changes a row's
    bits, and at batch 64 it keeps the grid at 1024 programs instead of 16384 mostly idle ones.
    ``splits`` defaults to the policy's ``exact_splits``; ``scales``: an e4m3 pool's row scales; ``sinks``:
    per-head sink logits ``[Hq]`` joining each row's softmax once; ``positions``: each row's token list
    (``seq_lens`` its count) instead of its first ``seq_lens`` tokens."""
    splits = current().exact_splits if splits is None else splits
    if splits < 1:
        raise ValueError(f"paged_decode_attention_fixed needs at least 1 split, got {splits}")
    grid = programs_per_row(q.shape[0], k_cache.shape[2])
    return decode_attention_with_splits(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        window,
        splits,
        grid,
        scales=scales,
        sinks=sinks,
        positions=positions,
    )


def expand_rows(
    block_tables: torch.Tensor, seq_lens_cpu: list[int], q_lens_cpu: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query row as its own decode row: ``(row index, block tables, seq_lens)``.

    Row ``j`` of a sequence with ``n`` rows and ``seq_len`` tokens attends to ``seq_len - n + j + 1`` tokens
    through its own table, exactly the decode row of that position. Built from host lists (no device sync);
    sequences with no rows are skipped, a padding sequence (``seq_len`` 0) stays a zero-length row."""
    seq_of_row: list[int] = []
    lens: list[int] = []
    for i, (length, n) in enumerate(zip(seq_lens_cpu, q_lens_cpu, strict=True)):
        seq_of_row.extend([i] * n)
        lens.extend(range(length - n + 1, length + 1) if length else [0] * n)
    device = block_tables.device
    index = torch.tensor(seq_of_row, dtype=torch.int64).to(device, non_blocking=True)
    seq_lens = torch.tensor(lens, dtype=torch.int32).to(device, non_blocking=True)
    return index, block_tables.index_select(0, index), seq_lens


def canonical_route(batch: ForwardBatch, device: torch.device) -> StepRoute | None:
    """The step's route (``batch.route``), or every row canonical under ``batch_invariant`` when the engine set
    none; None with routing off."""
    if batch.route is not None:
        return batch.route
    policy = current()
    if not (policy.exact_routing and policy.batch_invariant):
        return None
    return route_for(batch.q_lens_cpu, device, per_row=True)


def rows_per_call(heads: int, v_dim: int) -> int:
    """Rows of one fixed-split call whose split partials fit ``_PARTIALS_PER_CALL`` (``heads`` query heads of
    ``v_dim``): a prompt run row by row goes in calls of this many rows, which changes no bits."""
    return max(1, _PARTIALS_PER_CALL // (heads * current().exact_splits * next_pow2(v_dim)))


def expanded_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    scales: KVScales = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every row of the step as the decode row of its position (``expand_rows``) through the fixed-split kernel
    (a speculative verify, or a prompt row by row under ``batch_invariant``). Rows are independent, so cutting
    a long prompt into calls whose split partials fit ``_PARTIALS_PER_CALL`` changes no bits."""
    _, tables, seq_lens = expand_rows(batch.block_tables, batch.seq_lens_cpu, batch.q_lens_cpu)
    per_call = rows_per_call(q.shape[1], v_cache.shape[-1])

    def rows(a: int, b: int) -> torch.Tensor:
        return paged_decode_attention_fixed(
            q[a:b], k_cache, v_cache, tables[a:b], seq_lens[a:b], scale, scales=scales, sinks=sinks
        )

    if q.shape[0] <= per_call:
        return rows(0, q.shape[0])
    return torch.cat([rows(r, r + per_call) for r in range(0, q.shape[0], per_call)])


def decode_rows_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    route: StepRoute,
    scale: float,
    scales: KVScales = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fixed-split attention of a mixed step's decode rows (``route.exact_rows``), in that order."""
    assert route.exact_rows is not None and route.exact_seq_index is not None
    seqs = route.exact_seq_index
    return paged_decode_attention_fixed(
        q.index_select(0, route.exact_rows),
        k_cache,
        v_cache,
        batch.block_tables.index_select(0, seqs),
        batch.seq_lens.index_select(0, seqs),
        scale,
        scales=scales,
        sinks=sinks,
    )
