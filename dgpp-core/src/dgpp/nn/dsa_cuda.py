"""The DSA indexer's CUDA path: every row's selection as device tensors (``DeviceSelection``).

Scores come from ``dgpp.kernels.dsa_index`` (each (row, token) score from that row's query and that token's key
alone), the picks from a per-row radix select that reads each row's own scores only (``dgpp.kernels.top_k_rows``,
``radix_pick_fits``; else ``select_top_k``): the same tokens, ties and order as the torch path's row-by-row
``top_k_lowest_on_ties``. A decode-only step reads only the step's device tensors, so it can be captured in a
CUDA graph; other steps give each query row its own table and visible length (``expand_rows``).
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import use_triton
from dgpp.kernels.dsa_index import index_scores, select_top_k
from dgpp.kernels.top_k_rows import top_k_rows_triton
from dgpp.nn.exact.attention import expand_rows
from dgpp.nn.selection import DeviceSelection
from dgpp.step.batch import ForwardBatch

_SCORES_PER_CALL = 1 << 26  # fp32 scores held at once (256 MB): rows per call = this / the table's width
# the radix select runs one program per row: enough rows fill the GPU, and a short table is a few passes for one;
# a lone row over a wide table (a long-context graph's) would run its whole select on one SM, so it keeps torch's
# multi-block top-k (docs/benchmarks.md: GLM-5.3 at 32K, batch 1, both ways)
RADIX_MIN_ROWS = 8
RADIX_MAX_LONE_WIDTH = 8192


def radix_pick_fits(rows: int, width: int) -> bool:
    """Whether the per-row radix select picks this step's rows (the same picks as ``select_top_k`` either way)."""
    return rows >= RADIX_MIN_ROWS or width <= RADIX_MAX_LONE_WIDTH


def device_selection(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    batch: ForwardBatch,
    topk: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
) -> DeviceSelection | None:
    """Each row's ``topk`` picks among its visible tokens; None when the table is too short for any row to see
    more than ``topk`` tokens (every row dense: the decision depends on the table's width alone)."""
    width = batch.block_tables.shape[1] * k_cache.shape[1]
    if width <= topk:
        return None
    if batch.is_decode_only:
        tables, lens = batch.block_tables, batch.seq_lens
    else:
        _, tables, lens = expand_rows(batch.block_tables, batch.seq_lens_cpu, batch.q_lens_cpu)
    step = max(1, _SCORES_PER_CALL // width)
    pick = top_k_rows_triton if use_triton(q) and radix_pick_fits(q.shape[0], width) else select_top_k
    picks = [
        pick(
            index_scores(
                q[r : r + step],
                weights[r : r + step],
                k_cache,
                tables[r : r + step],
                lens[r : r + step],
                scale,
                k_scale,
            ),
            lens[r : r + step],
            topk,
        )
        for r in range(0, q.shape[0], step)
    ]
    positions = picks[0][0] if len(picks) == 1 else torch.cat([p for p, _ in picks])
    counts = picks[0][1] if len(picks) == 1 else torch.cat([c for _, c in picks])
    # a row with at most topk tokens attends them all as the dense path does, whatever the table's width
    return DeviceSelection(positions, counts, (lens > topk).to(torch.int32))
