"""Full attention with per-head sinks over the paged pool (Flint's and MiMo's full-attention layers), routed by row.

A decode row's span is its whole context. ``dgpp.kernels.window_attention`` gives each (row, KV head) one
program, so at batch 1 a 32K-token row walks its keys in as many programs as the layer has KV heads (MiMo: 4)
while the rest of the GPU idles. On CUDA the canonical rows therefore take the split-context kernel
(``dgpp.nn.exact.attention.paged_decode_attention_fixed`` with the sinks): each row's span is cut into
``exact_splits`` (``dgpp.policy``) ``BLOCK_N``-multiple partitions decided on the device from the row's own
length, each partition's partial softmax is its own program, and a second kernel merges the row's partials,
the sink in split 0's partial only. The rows follow the step's route (``dgpp.step.route``), as the paged layers' do:

- a decode-only step: every row, whatever the routing policy (its bits depend on the row alone either way);
- a speculative verify, or any step under ``batch_invariant``: every row, as the decode row of its position
  (``expand_rows``), so a verify row has the bits of the plain decode row it stands for;
- a mixed step: its decode rows; the prefill chunks' rows run the window kernel's full-context form (keys walked
  from position 0 in fixed tiles, four rows of a prompt sharing each tile: ``dgpp.kernels.full_attention_rows``;
  a row's bits do not depend on how its prompt was chunked), which the decode rows skip (their ``seq_len``
  zeroed for that launch, so they walk no keys there);
- prefill chunks alone, or routing off with chunks in the step: the window kernel for every row.

Heads wider than 256 (no Flint / MiMo layer) keep the window kernel, whose wide-head tiles fit the SM. Off CUDA
every row runs ``window_attention``'s torch reference.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import use_triton
from dgpp.kernels.full_attention_rows import full_attention_rows_triton, prompt_row_blocks, takes_rows
from dgpp.kernels.kv_fp8 import KVScales
from dgpp.kernels.window_attention import window_attention
from dgpp.nn.exact.attention import (
    canonical_route,
    decode_rows_attention,
    expanded_decode_attention,
    paged_decode_attention_fixed,
)
from dgpp.step.batch import ForwardBatch

_SPLIT_MAX_HEAD_DIM = 256  # the split kernel's query / key / value tiles are one head wide


def paged_sink_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    sinks: torch.Tensor | None,
    scale: float,
    scales: KVScales = None,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, Hq, D]`` against the paged pool (this step's K/V already stored) -> ``[T, Hq, Dv]``; ``scales``: an
    e4m3 pool's row scales, ``row_seq``: the step's ``row_sequences`` for the window kernel."""

    def windowed(seq_lens: torch.Tensor) -> torch.Tensor:
        step = (batch.block_tables, batch.query_start_loc, batch.context_lens, seq_lens, sinks, scale)
        if use_triton(q) and takes_rows(q, v_cache):  # prompt rows four to a program
            blocks = batch.step_memo(
                "prompt_row_blocks", lambda: prompt_row_blocks(batch.q_lens_cpu, q.device)
            )
            return full_attention_rows_triton(q, k_cache, v_cache, *step, blocks, scales, row_seq)
        return window_attention(q, None, None, k_cache, v_cache, *step, 0, True, scales, row_seq=row_seq)

    if not use_triton(q) or max(q.shape[-1], v_cache.shape[-1]) > _SPLIT_MAX_HEAD_DIM:
        return windowed(batch.seq_lens)
    if batch.is_decode_only:  # one row per sequence (graph padding rows keep seq_len 0)
        return paged_decode_attention_fixed(
            q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, scales=scales, sinks=sinks
        )
    route = canonical_route(batch, q.device)
    if route is None or route.none_exact:
        return windowed(batch.seq_lens)
    if route.all_exact:
        return expanded_decode_attention(q, k_cache, v_cache, batch, scale, scales, sinks)
    assert route.exact_rows is not None and route.exact_seq_index is not None
    out = windowed(batch.seq_lens.index_fill(0, route.exact_seq_index, 0))
    out.index_copy_(
        0, route.exact_rows, decode_rows_attention(q, k_cache, v_cache, batch, route, scale, scales, sinks)
    )
    return out
