"""MLA's CUDA path: the absorbed form as Triton kernels, every query row its own decode row.

``q_lat = q_nope · W_uk`` and ``out = o_lat · W_uvᵀ`` run through ``head_matmul`` (a fixed row tile), the
attention through ``mla_attention`` over the latent cache: each row with its own block table and the number
of tokens it attends (its visible prefix, or its DSA selection's positions). A row's bits then depend on its
own inputs alone, so chunked prefill, batching, a prefix-cache hit and a speculative verify give a position
the same result on the GPU, as the torch path does on the CPU. A decode-only step with no selection reads
the step's device tensors directly (no host value), so that launch sequence can be captured in a CUDA graph;
a selection (DSA) is built from the indexer's host-side loop, which a graph cannot replay.
"""

from __future__ import annotations

import torch

from dgpp.kernels.head_matmul import head_matmul
from dgpp.kernels.mla_attention import mla_attention
from dgpp.nn.exact.attention import expand_rows
from dgpp.nn.selection import DeviceSelection, Selection
from dgpp.step.batch import ForwardBatch

_ROWS_PER_CALL = 64  # bounds the split partials ([rows, heads, splits, latent] fp32) of a long prefill


def absorbed_attention_cuda(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    kv_b: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    batch: ForwardBatch,
    selection: Selection | DeviceSelection | None,
    scale: float,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, H, v_head_dim]`` for this step's rows (before ``o_proj``): ``q_nope [T, H, nope]``, ``q_rot``
    ``[T, H, rope]``, ``kv_b`` ``[H, nope + v, latent]`` (``kv_b_proj``'s matrix per head). ``latent_scale``: the
    row scales of a quantized latent cache (``engine.kv_dtype`` fp8 / fp4)."""
    nope = q_nope.shape[-1]
    w_uk, w_uv = kv_b.split((nope, kv_b.shape[1] - nope), dim=1)  # [H, nope, L], [H, v, L]
    q_lat = head_matmul(q_nope, w_uk)
    tables, lens, indices, sparse = row_inputs(batch, selection, q_nope.device)
    step = _ROWS_PER_CALL
    pieces = [
        mla_attention(
            q_lat[r : r + step],
            q_rot[r : r + step],
            latent_cache,
            rope_cache,
            tables[r : r + step],
            lens[r : r + step],
            scale,
            None if indices is None else indices[r : r + step],
            None if sparse is None else sparse[r : r + step],
            latent_scale=latent_scale,
        )
        for r in range(0, q_lat.shape[0], step)
    ]
    o_lat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return head_matmul(o_lat, w_uv.transpose(1, 2))


def row_inputs(
    batch: ForwardBatch, selection: Selection | DeviceSelection | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per query row: block table, tokens attended, and (with a selection) the picked positions and which rows
    read them. A decode-only step reads the step's own device tensors (nothing from the host)."""
    if isinstance(selection, DeviceSelection):
        tables = batch.block_tables if batch.is_decode_only else row_tables(batch)
        sparse = selection.sparse
        if sparse is None:
            sparse = torch.ones(selection.counts.shape[0], dtype=torch.int32, device=device)
        return tables, selection.counts, selection.positions, sparse
    if batch.is_decode_only and (selection is None or all(s is None for s in selection)):
        return batch.block_tables, batch.seq_lens, None, None
    _, tables, lens = expand_rows(batch.block_tables, batch.seq_lens_cpu, batch.q_lens_cpu)
    picked = [] if selection is None else [r for r, s in enumerate(selection) if s is not None]
    if not picked:
        return tables, lens, None, None
    assert selection is not None
    chosen = [selection[r] for r in picked]
    width = max(int(c.shape[0]) for c in chosen)
    indices = torch.zeros(lens.shape[0], width, dtype=torch.int32, device=device)
    rows = torch.tensor(picked, dtype=torch.int64).to(device, non_blocking=True)
    if all(int(c.shape[0]) == width for c in chosen):
        indices.index_copy_(0, rows, torch.stack(chosen).to(torch.int32))
    else:
        for r, c in zip(picked, chosen, strict=True):
            indices[r, : c.shape[0]] = c.to(torch.int32)
    counts = torch.tensor([int(c.shape[0]) for c in chosen], dtype=torch.int32).to(device, non_blocking=True)
    lens = lens.index_copy(0, rows, counts)
    sparse = torch.zeros(lens.shape[0], dtype=torch.int32, device=device).index_fill_(0, rows, 1)
    return tables, lens, indices, sparse


def row_tables(batch: ForwardBatch) -> torch.Tensor:
    """Each query row's block table (its sequence's), for a step that is not decode-only."""
    return expand_rows(batch.block_tables, batch.seq_lens_cpu, batch.q_lens_cpu)[1]
