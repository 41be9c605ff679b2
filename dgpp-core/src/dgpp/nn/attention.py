"""Paged attention (torch reference path) and the sigmoid-gated attention output.

K/V live in the engine's pool, ``[num_blocks, block_size, kv_heads, dim]`` per layer. New rows are
written through ``slot_mapping``; each sequence then attends over its whole context, read back from
the pool through its ``block_table`` — so a prefill chunk sees the earlier chunks, and a decode row
sees everything before it. One code path serves prefill, decode and mixed batches. Under
``engine.kv_dtype: fp8`` the pool holds e4m3 rows and their scales (``dgpp.kernels.kv_fp8``): rows are
quantized as they are written (``store_kv``) and every reader dequantizes what it loads.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.kernels._triton import use_triton
from dgpp.kernels.kv_fp8 import KVScales, dequantize_rows, quantize_rows
from dgpp.kernels.latent_formats import latent_format_of, quantize_latent
from dgpp.nn.batch_invariant import rows_elementwise
from dgpp.policy import current
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import KV_FP8, PagedKV

_NARROW = (torch.bfloat16, torch.float16)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as bytes: torch's CPU index_copy_ / index_select have no float8 kernels, and moving codes
    needs their bits only."""
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t


def kv_write_rows(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(rows, slots)`` of a step's K/V write: the rows to store (None: all of them) and their int64 slots."""
    keep = slot_mapping >= 0
    rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
    slots = (slot_mapping if rows is None else slot_mapping.index_select(0, rows)).long()
    return rows, slots


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    rows_slots: tuple[torch.Tensor | None, torch.Tensor] | None = None,
) -> None:
    """Store rows ``k``/``v`` ``[T, kv_heads, dim]`` at flat slots ``slot_mapping`` (−1: skip the row).
    ``rows_slots``: ``kv_write_rows(slot_mapping)`` when the caller has it (the same for every layer of a step).

    ``index_select`` / ``index_copy_`` rather than boolean-mask indexing: on a 2-core CPU the advanced-index
    path measured ~100x slower for these few rows (it dominated a decode step)."""
    rows, slots = rows_slots or kv_write_rows(slot_mapping)
    for cache, new in ((k_cache, k), (v_cache, v)):
        kept = new if rows is None else new.index_select(0, rows)
        # flatten, not view(-1, ...): a zero-width cache (MLA without RoPE keeps no rotated key) has no -1 to infer
        _bits(cache).flatten(0, 1).index_copy_(0, slots, _bits(_as(kept, cache.dtype)))


def store_kv(batch: ForwardBatch, name: str, k: torch.Tensor, v: torch.Tensor) -> KVScales:
    """Write this step's K/V rows ``[T, kv_heads, dim]`` into pool entry ``name`` at ``batch.slot_mapping``:
    quantized to e4m3 rows with their fp32 scales when the entry is stored so (``engine.kv_dtype: fp8``), as
    they are otherwise (on CUDA quantized and stored in one launch for K and one for V,
    ``dgpp.kernels.quantized_write``). Returns the entry's scales (None for a compute-dtype entry) for the read that
    follows."""
    k_cache, v_cache = batch.cache.kv[name]
    scales = batch.cache.kv_scales.get(name)
    if scales is not None and use_triton(k):
        from dgpp import kernels

        kernels.write_quantized(k_cache, scales[0], k, batch.slot_mapping)
        kernels.write_quantized(v_cache, scales[1], v, batch.slot_mapping)
        return scales
    if scales is not None:
        (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
        scatter_rows(batch, scales[0], scales[1], k_scale, v_scale)
    scatter_rows(batch, k_cache, v_cache, k, v)
    return scales


def store_keys(batch: ForwardBatch, name: str, k: torch.Tensor) -> torch.Tensor | None:
    """Write this step's key rows ``[T, 1, dim]`` into K-only pool entry ``name`` (no V: DSA index keys) at
    ``batch.slot_mapping``, as e4m3 rows with their fp32 scales when the entry is stored so (``engine.kv_dtype``
    fp8 or fp4). Returns the key scales (None for a compute-dtype entry) for the read that follows."""
    store_row_scaled(batch, name, k, k[..., :0])
    scales = batch.cache.kv_scales.get(name)
    return None if scales is None else scales[0]


def store_row_scaled(batch: ForwardBatch, name: str, rows: torch.Tensor, beside: torch.Tensor) -> None:
    """Write this step's one-head rows ``[T, 1, width]`` into the first tensor of pool entry ``name`` and ``beside``
    (``[T, 1, w]``: an MLA latent's ``k_rot``, or nothing) into its second, at ``batch.slot_mapping``. When the entry
    is stored row-scaled (``engine.kv_dtype`` fp8 / fp4: e4m3 codes or packed fp4 rows, one fp32 scale a row),
    ``rows`` are quantized on the way in (``dgpp.kernels.latent_formats``), ``beside`` stays as it is: on CUDA in
    one launch (``dgpp.kernels.quantized_write``), elsewhere the torch encoder then the scatters."""
    first, second = batch.cache.kv[name]
    scales = batch.cache.kv_scales.get(name)
    if scales is None:
        scatter_rows(batch, first, second, rows, beside)
    elif use_triton(rows):
        from dgpp import kernels

        kernels.write_quantized(first, scales[0], rows, batch.slot_mapping, second, beside)
    else:
        stored, row_scale = quantize_latent(rows, latent_format_of(first))
        scatter_rows(batch, scales[0], scales[1], row_scale, row_scale[..., :0])
        scatter_rows(batch, first, second, stored, beside)


def scatter_rows(
    batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store rows ``k`` / ``v`` in a paged pair at the step's slots, as they are."""
    if k.is_cuda:  # Triton: no host syncs, so a decode step can be captured in a CUDA graph
        from dgpp import kernels

        kernels.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    else:
        rows_slots = batch.step_memo("kv_write_rows", lambda: kv_write_rows(batch.slot_mapping))
        write_kv(k_cache, v_cache, k, v, batch.slot_mapping, rows_slots)


def read_rows(
    cache: torch.Tensor, scale: torch.Tensor | None, token_rows: torch.Tensor | slice, dtype: torch.dtype
) -> torch.Tensor:
    """Pool rows ``token_rows`` of ``cache`` in ``dtype``: gathered, and dequantized when ``scale`` is given."""
    rows = gather_rows(cache, token_rows)
    return rows if scale is None else dequantize_rows(rows, gather_rows(scale, token_rows), dtype)


def context_token_rows(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The flat pool rows (``block * block_size + offset``) of a sequence's first ``length`` tokens, in order."""
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].long()
    if num_blocks and int(blocks.min()) < 0:
        raise ValueError(f"block table covers fewer than {length} tokens")
    offsets = torch.arange(block_size, device=blocks.device)
    return (blocks[:, None] * block_size + offsets).flatten()[:length]


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` token rows of one sequence, ``[length, kv_heads, dim]``, in order."""
    return gather_rows(cache, context_token_rows(block_table, length, cache.shape[1]))


def consecutive_span(block_table: torch.Tensor, length: int, block_size: int) -> slice | None:
    """The pool rows of a sequence's first ``length`` tokens as one slice when its blocks are consecutive ids
    (a pool hands a lone stream consecutive blocks), else None. Host tables only: the check reads ids."""
    num_blocks = -(-length // block_size)
    if num_blocks == 0 or block_table.device.type != "cpu":
        return None
    blocks = block_table[:num_blocks]
    first = int(blocks[0])
    if first < 0 or not torch.equal(blocks.long(), torch.arange(first, first + num_blocks)):
        return None
    return slice(first * block_size, first * block_size + length)


def gather_rows(cache: torch.Tensor, token_rows: torch.Tensor | slice) -> torch.Tensor:
    """Pool rows ``token_rows`` (``context_token_rows``, or a ``consecutive_span``: a view, no copy) of
    ``cache``, ``[len, kv_heads, dim]``."""
    if isinstance(token_rows, slice):
        return cache.flatten(0, 1)[token_rows]
    rows = _bits(cache).flatten(0, 1).index_select(0, token_rows)
    return rows if rows.dtype == cache.dtype else rows.view(cache.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float) -> torch.Tensor:
    """Causal GQA attention for one sequence: query row ``i`` sits at position ``q_offset + i`` and sees
    keys ``0..q_offset+i``. ``q`` [n, Hq, D], ``k`` [L, Hkv, D], ``v`` [L, Hkv, Dv] -> [n, Hq, Dv].

    Each row is computed over exactly its visible keys (no masked tail), all heads in one batched product
    whose shape depends on the row's position alone: a position's output is then bit-identical however the
    prompt was chunked, batched or restored from a prefix cache. The products' results are rounded to the
    activation dtype and the softmax runs in fp32 (probabilities cast back), the rounding points of the
    reference implementations. bf16/fp16 products are computed in fp32 on the CPU (exact widening, fp32
    accumulation, one rounding): the CPU's narrow batched product builds a oneDNN primitive per call, which
    measured ~2x slower for a decode row on one thread and far worse on two. Casts to the dtype a tensor
    already has are skipped (a decode row's attention is a few dozen small ops: each one counts)."""
    n, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    dtype = q.dtype
    compute = torch.float32 if q.device.type == "cpu" and dtype in _NARROW else dtype
    grouped = _as(
        q.reshape(n, num_kv_heads, group, -1) if n > 1 else q.reshape(num_kv_heads, group, -1), compute
    )
    k_t = _as(_as(k, dtype), compute).permute(1, 2, 0)  # [Hkv, D, L]
    v_h = _as(_as(v, dtype), compute).transpose(0, 1)  # [Hkv, L, Dv]
    length = k.shape[0]
    rows = []
    for i in range(n):
        visible = q_offset + i + 1
        keys, values = (k_t, v_h) if visible == length else (k_t[:, :, :visible], v_h[:, :visible])
        row = grouped if n == 1 else grouped[i]  # [Hkv, group, D]
        scores = _as(torch.bmm(row, keys), dtype) * scale  # [Hkv, group, visible]
        probs = _as(torch.softmax(scores, dim=-1, dtype=torch.float32), dtype)
        rows.append(torch.bmm(_as(probs, compute), values))
    out = rows[0] if n == 1 else torch.stack(rows)  # one row's [Hkv, group, Dv] reshapes as [1, Hkv, ...]
    return _as(out, dtype).reshape(n, num_q_heads, -1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    scales: KVScales = None,
) -> torch.Tensor:
    """Varlen causal attention over the paged cache, after this step's K/V were written.

    ``q`` is ``[T, Hq, D]`` (flattened rows of all sequences); returns ``[T, Hq, Dv]``. ``scales``: the
    entry's (k_scale, v_scale) when it holds e4m3 rows (dequantized to q's dtype as they are gathered).
    """
    k_scale, v_scale = scales if scales is not None else (None, None)
    # one sequence with rows and context (a single stream's step): its rows are the output, no scatter
    if batch.num_seqs == 1 and batch.q_lens_cpu[0] and batch.seq_lens_cpu[0]:
        rows = _context_rows(batch, 0, k_cache.shape[1])
        k, v = read_rows(k_cache, k_scale, rows, q.dtype), read_rows(v_cache, v_scale, rows, q.dtype)
        return attend(q, k, v, batch.context_lens_cpu[0], scale)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    start = 0
    for i, q_len in enumerate(batch.q_lens_cpu):
        if q_len == 0:
            continue
        length = batch.seq_lens_cpu[i]
        if length == 0:  # a CUDA-graph padding row (seq_len 0): no context, zeros, as the Triton kernel gives
            out[start : start + q_len] = 0
            start += q_len
            continue
        rows = _context_rows(batch, i, k_cache.shape[1])
        k, v = read_rows(k_cache, k_scale, rows, q.dtype), read_rows(v_cache, v_scale, rows, q.dtype)
        out[start : start + q_len] = attend(q[start : start + q_len], k, v, batch.context_lens_cpu[i], scale)
        start += q_len
    return out


def _context_rows(batch: ForwardBatch, i: int, block_size: int) -> torch.Tensor | slice:
    """Sequence ``i``'s context pool rows (one slice where its blocks are consecutive), computed once a step:
    every layer of the step reads the same rows."""

    def rows() -> torch.Tensor | slice:
        table, length = batch.block_tables[i], batch.seq_lens_cpu[i]
        span = consecutive_span(table, length, block_size)
        return context_token_rows(table, length, block_size) if span is None else span

    return batch.step_memo(("context_rows", i, block_size), rows)


class PagedAttention(nn.Module):
    """Attention core of one layer: write this step's K/V into the pool entry ``cache_name``, then
    attend. Inputs ``[T, heads, dim]`` (after RoPE and any q/k norm); output ``[T, Hq*Dv]``."""

    def __init__(
        self, cache_name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.cache_name = cache_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale

    def cache_entries(self, dtype: torch.dtype) -> dict[str, PagedKV]:
        """This layer's paged K/V entry (the model's ``cache_spec`` collects it); its readers take e4m3 rows."""
        return {self.cache_name: PagedKV(self.num_kv_heads, self.head_dim, dtype, fp8_rows=True)}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = batch.cache.kv[self.cache_name]
        scales = store_kv(batch, self.cache_name, k, v)
        if q.is_cuda:
            from dgpp import kernels

            routed = _routed_attention(q, k_cache, v_cache, batch, self.scale, scales)
            if routed is not None:
                return routed.flatten(1)
            if batch.is_decode_only:
                return kernels.paged_decode_attention(
                    q, k_cache, v_cache, batch.block_tables, batch.seq_lens, self.scale, scales=scales
                ).flatten(1)
            # H200, 8K-token prefill, 32/8 heads x 128: 3.5 ms against 49.5 ms for the torch path (which holds
            # the score matrix); DGPP_PREFILL_ATTN=torch keeps the torch path for A/B
            if current().prefill_attention != "torch":
                return kernels.paged_prefill_attention(
                    q,
                    k_cache,
                    v_cache,
                    batch.block_tables,
                    batch.query_start_loc,
                    batch.context_lens,
                    self.scale,
                    host=_host_starts(batch.q_lens_cpu, batch.context_lens_cpu),
                    scales=scales,
                ).flatten(1)
        return paged_attention(q, k_cache, v_cache, batch, self.scale, scales).flatten(1)


def _routed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    scales: KVScales = None,
) -> torch.Tensor | None:
    """Attention by the step's route (``batch.route``, ``dgpp.nn.exact``): canonical rows through the fixed-split decode
    kernel, each as its own decode row; bulk (prefill-chunk) rows through the flash prefill kernel. None when
    routing is off."""
    from dgpp.nn.exact.attention import (
        canonical_route,
        decode_rows_attention,
        expanded_decode_attention,
        paged_decode_attention_fixed,
    )

    route = canonical_route(batch, q.device)
    if route is None:
        return None
    from dgpp import kernels

    if batch.is_decode_only:  # one row per sequence already (graph padding rows keep seq_len 0)
        return paged_decode_attention_fixed(
            q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, scales=scales
        )
    if route.all_exact:
        return expanded_decode_attention(q, k_cache, v_cache, batch, scale, scales)
    # prefill chunks: the flash kernel over the chunk sequences (its programs each hold rows of one sequence,
    # so a row depends on its own sequence only); decode rows beside them: the canonical kernel
    if route.none_exact:
        return kernels.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.query_start_loc,
            batch.context_lens,
            scale,
            host=_host_starts(batch.q_lens_cpu, batch.context_lens_cpu),
            scales=scales,
        )
    assert (
        route.bulk_rows is not None
        and route.bulk_seq_index is not None
        and route.bulk_query_starts is not None
    )
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    bulk_seqs = route.bulk_seq_index
    host = _host_starts(
        [b - a for a, b in route.bulk_ranges], [batch.context_lens_cpu[i] for i in route.bulk_seqs]
    )
    out.index_copy_(
        0,
        route.bulk_rows,
        kernels.paged_prefill_attention(
            q.index_select(0, route.bulk_rows),
            k_cache,
            v_cache,
            batch.block_tables.index_select(0, bulk_seqs),
            route.bulk_query_starts,
            batch.context_lens.index_select(0, bulk_seqs),
            scale,
            host=host,
            scales=scales,
        ),
    )
    assert route.exact_rows is not None
    decoded = decode_rows_attention(q, k_cache, v_cache, batch, route, scale, scales)
    out.index_copy_(0, route.exact_rows, decoded)
    return out


def _host_starts(q_lens: list[int], context_lens: list[int]) -> tuple[list[int], list[int]]:
    """The prefill kernel's ``query_start_loc`` and ``context_lens`` from the batch's host lists (no device read)."""
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return starts, list(context_lens)


def split_query_gate(
    q_proj_out: torch.Tensor, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's ``[q|gate]`` q_proj packs, per head, ``head_dim`` query dims then ``head_dim`` gate dims.
    Returns ``q`` and ``gate``, both ``[T, H, D]`` views of the projection (nothing is copied)."""
    per_head = q_proj_out.view(q_proj_out.shape[0], num_heads, 2 * head_dim)
    q, gate = per_head.split(head_dim, dim=-1)
    return q, gate


def gated_output(attn_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Per-element sigmoid output gate applied before o_proj: ``attn_out [T, H*D]``, ``gate`` ``[T, H*D]`` or
    ``[T, H, D]`` (one Triton launch on CUDA, reading a strided gate in place)."""
    if attn_out.is_cuda and gate.dim() == 3:
        from dgpp import kernels

        return kernels.sigmoid_gate(attn_out, gate)
    return attn_out * rows_elementwise(torch.sigmoid, gate).reshape(attn_out.shape)
